"""`meshlm data prepare [flags]`: tokenize a corpus in parallel into token shards (meshlm.data.prepare), once,
before training; several processes (hosts sharing the cache folder) split the work."""

from __future__ import annotations

from meshlm import config
from meshlm.cli.flags import Parser, add_dataclass_flags, add_section_flags
from meshlm.errors import UsageError

ACTIONS = ("prepare",)


def parser() -> Parser:
    p = Parser(
        prog="meshlm data",
        usage="meshlm data prepare [flags]",
        description="Tokenize a dataset into token shards under the cache folder (docs/data.md, Preparing data).",
    )
    add_section_flags(p, config.DataConfig, title="data", only=("dataset", "tokenizer"))
    add_section_flags(p, config.ChatDataConfig, title="text", only=("text_field",))
    vocab = p.add_argument_group("the default tokenizer (a BPE trained on the dataset, as meshlm train does)")
    vocab.add_argument("--vocab_size", type=int, help="its vocabulary [default: --model's vocab_size]")
    add_dataclass_flags(
        vocab,
        config.ModelSection,
        only=("model",),
        meaning={"model": "take --vocab_size from this preset or config.json [default: tiny]"},
    )
    work = p.add_argument_group("preparation")
    work.add_argument("--workers", type=int, help="worker processes [default: the CPU count, at most the units]")
    work.add_argument(
        "--unit_mb",
        type=float,
        help="input MB per unit of work, cut at documents [default: the corpus over 64, 1 to 256]",
    )
    work.add_argument(
        "--cache_dir",
        help="cache folder [default: $MESHLM_CACHE, else ~/.cache/meshlm]; meshlm train reads the shards from "
        "$MESHLM_CACHE, so set it to this same folder",
    )
    add_section_flags(p, config.ClusterConfig, title="several processes", only=("num_processes", "process_id"))
    return p


def vocab_size(args) -> int:
    """--vocab_size, else the vocabulary of --model (a preset or config.json; default tiny, as in meshlm train)."""
    if args.vocab_size is not None:
        if args.vocab_size < 2:
            raise UsageError(f"--vocab_size={args.vocab_size} must be at least 2")
        return args.vocab_size
    from meshlm.job import preset_name
    from meshlm.models.presets import resolve_model

    return resolve_model(preset_name(args.model or "tiny"), {}).vocab_size


def check(args) -> tuple[int, int]:
    """(process index, process count) from the flags; one line for bad values."""
    count = 1 if args.num_processes is None else args.num_processes
    index = 0 if args.process_id is None else args.process_id
    if count < 1:
        raise UsageError(f"--num_processes={count} must be at least 1")
    if not 0 <= index < count:
        raise UsageError(f"--process_id={index} must be in 0 .. {count - 1} (--num_processes={count})")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers={args.workers} must be a positive integer")
    if args.unit_mb is not None and int(args.unit_mb * 2**20) < 1:
        raise UsageError(f"--unit_mb={args.unit_mb} must be positive, e.g. 256")
    config.ChatDataConfig(text_field=args.text_field).check()
    return index, count


def run(argv: list[str]) -> int:
    flags = parser()
    if argv[:1] in (["-h"], ["--help"]):
        flags.print_help()
        return 0
    if not argv or argv[0] not in ACTIONS:
        what = f"unknown action {argv[0]!r}" if argv else "no action"
        raise UsageError(f"{what}: write meshlm data prepare [flags] (see `meshlm data --help`)")
    args = flags.parse_args(argv[1:])
    index, count = check(args)
    from meshlm.data.corpus import is_synthetic
    from meshlm.data.mixture import is_mixture, load_tokenizer, read_mixture
    from meshlm.data.prepare import prepare_tokens

    if is_synthetic(args.dataset):
        raise UsageError("the synthetic dataset is random tokens made on the fly; there is nothing to prepare")
    tokenizer = load_tokenizer(
        args.tokenizer, args.dataset, vocab_size(args), cache_dir=args.cache_dir, text_field=args.text_field
    )
    # A mixture's sources are prepared one after another, each as `meshlm train` reads it.
    sources = read_mixture(args.dataset).sources if is_mixture(args.dataset) else ()
    for dataset, text_field in [(s.dataset, s.text_field or args.text_field) for s in sources] or [
        (args.dataset, args.text_field)
    ]:
        prepare_tokens(
            dataset,
            tokenizer,
            cache_dir=args.cache_dir,
            text_field=text_field,
            workers=args.workers,
            process_index=index,
            process_count=count,
            unit_bytes=None if args.unit_mb is None else int(args.unit_mb * 2**20),
        )
    return 0
