"""`meshlm eval`: lm-evaluation-harness tasks on a checkpoint, in this process, on the mesh.

The model, mesh and engine flags are `meshlm generate`'s (meshlm/cli/serve.py), and so is the loading;
lm-eval runs meshlm's own model class (meshlm/eval/lm.py) and writes its usual JSON. Everything the
flags can get wrong (lm-eval missing, a task that does not exist, a folder that is not there) is
found before the model loads: one line naming the fix, exit code 2.
"""

from __future__ import annotations

import time
from pathlib import Path

from meshlm.cli.flags import Parser
from meshlm.cli.serve import add_model_flags, load
from meshlm.errors import UsageError


def _parser() -> Parser:
    parser = Parser(
        prog="meshlm eval",
        description="Run lm-evaluation-harness tasks on a checkpoint, in this process, on the mesh (docs/eval.md).",
    )
    add_model_flags(
        parser,
        max_batch=None,
        meaning={
            "max_seq_len": "the context: the longest sequence scored, or prompt + generated tokens [default: the "
            "model's, at most 2048]",
            "max_batch": "generation engine slots, for tasks that generate; a multiple of dp×fsdp [default: "
            "--batch_size rounded up to one]",
        },
    )
    g = parser.add_argument_group("evaluation (lm-evaluation-harness)")
    g.add_argument(
        "--tasks",
        required=True,
        metavar="A,B",
        help="lm-eval task, group or tag names (globs too), task names from --include_path, or task "
        "YAML files, comma-separated",
    )
    g.add_argument(
        "--include_path",
        metavar="DIR",
        help="a folder of task YAML files (local tasks: dataset_path: json, dataset_kwargs: {data_files: ...})",
    )
    g.add_argument("--num_fewshot", type=int, help="examples shown before each question [default: each task's]")
    g.add_argument(
        "--limit",
        type=float,
        help="evaluate only the first N examples of each task, or a fraction of them when below 1 [default: all]",
    )
    g.add_argument(
        "--batch_size",
        type=int,
        default=8,
        help="sequences per forward when scoring, and engine slots when generating [default: 8]",
    )
    g.add_argument(
        "--max_gen_toks",
        type=int,
        default=256,
        help="new tokens at most per generation, where a task does not say [default: 256]",
    )
    g.add_argument(
        "--output_path",
        metavar="P",
        help="write lm-eval's results JSON into this folder (under the "
        "model's name), or to this .json path [default: print only]",
    )
    g.add_argument(
        "--log_samples",
        action="store_true",
        help="also write every sample's prompt, answers and scores (samples_<task>_<date>.jsonl); needs --output_path",
    )
    g.add_argument("--seed", type=int, default=1234, help="for few-shot picks and sampled generations [default: 1234]")
    return parser


def _check(args) -> None:
    """Every flag that can be checked without lm-eval or the model."""
    for flag in ("batch_size", "max_gen_toks"):
        if getattr(args, flag) <= 0:
            raise UsageError(f"--{flag}={getattr(args, flag)} must be a positive integer")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UsageError(f"--num_fewshot={args.num_fewshot} must be 0 or more")
    if args.limit is not None:
        if args.limit <= 0 or (args.limit >= 1 and args.limit != int(args.limit)):
            raise UsageError(f"--limit={args.limit:g}: give a number of examples (1, 2, ...) or a fraction in (0, 1)")
        args.limit = int(args.limit) if args.limit >= 1 else args.limit
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise UsageError(
            f"--include_path={args.include_path} is not a folder; give the folder holding your task YAML files"
        )
    if args.log_samples and not args.output_path:
        raise UsageError("--log_samples writes files: give --output_path=FOLDER as well")
    if args.output_path is not None:
        out = Path(args.output_path)
        if out.suffix != ".json" and out.exists() and not out.is_dir():
            raise UsageError(f"--output_path={out} is a file; give a folder or a path ending in .json")
    if not args.checkpoint.startswith("hf:") and not Path(args.checkpoint).expanduser().exists():
        raise UsageError(f"--checkpoint={args.checkpoint} does not exist")
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise UsageError(f"--max_seq_len={args.max_seq_len} must be at least 2")
    if args.prefill_buckets:
        try:
            args.prefill_buckets = tuple(int(b) for b in args.prefill_buckets.split(","))
        except ValueError:
            raise UsageError(
                f"--prefill_buckets={args.prefill_buckets}: give comma-separated lengths like 64,256"
            ) from None


def run(argv: list[str]) -> int:
    from meshlm import distributed
    from meshlm.eval.harness import find_tasks, require_lm_eval

    args = _parser().parse_args(argv)
    _check(args)
    require_lm_eval()
    manager, tasks = find_tasks(args.tasks.split(","), args.include_path)
    return distributed.run_here(distributed.Cluster(), lambda main: _evaluate(args, manager, tasks), args.devices)


def _evaluate(args, manager, tasks: list[str]) -> int:
    from rich.console import Console

    from meshlm.eval.harness import run_tasks, summary_table, write_results
    from meshlm.eval.lm import MeshLM
    from meshlm.serve.engine.shapes import plan_shapes

    err, out = Console(stderr=True), Console()
    if not out.is_terminal:  # a file or a pipe: whole names and numbers, however wide the table
        out = Console(width=200)
    model, shape = load(args, err)
    context = args.max_seq_len or min(model.cfg.max_seq_len, 2048)
    slots = args.max_batch or -(-args.batch_size // shape.data) * shape.data  # the engine's, if a task generates
    plan_shapes(
        model.cfg.max_seq_len,
        max_batch=slots,
        max_seq_len=context,
        prefill_buckets=args.prefill_buckets,
        prefill_batch=None,
        data=shape.data,
        sp=shape.sp,
    )  # its shapes checked before any work
    lm = MeshLM(
        model,
        batch_size=args.batch_size,
        context=context,
        max_gen_toks=args.max_gen_toks,
        engine_batch=slots,
        prefill_buckets=args.prefill_buckets,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    try:
        results, tracker = run_tasks(
            lm,
            tasks,
            manager,
            num_fewshot=args.num_fewshot,
            limit=args.limit,
            log_samples=args.log_samples,
            seed=args.seed,
            model_name=args.checkpoint,
            output_path=args.output_path,
        )
    finally:
        lm.close()
    seconds = time.perf_counter() - t0
    out.print(
        f"meshlm ({model.name}), limit: {args.limit}, num_fewshot: {args.num_fewshot}, "
        f"batch_size: {args.batch_size}, {seconds:.1f} s"
    )
    out.print(summary_table(results))
    if results.get("groups"):
        out.print(summary_table(results, "groups"))
    if args.output_path:
        for path in write_results(results, tracker):
            err.print(f"wrote {path}", soft_wrap=True)
    return 0
