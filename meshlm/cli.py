"""`meshlm <command> [flags]`. Each command is a thin layer over the library.

Bad input never reaches JAX: it is a one-line `error: ...` naming the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from meshlm.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2
        raise UsageError(f"{message} (see `meshlm {self.prog.split()[-1]} --help`)")


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, only: tuple[str, ...] | None = None) -> None:
    """A flag per field of `cls` (or only the fields named in `only`), with its help text and default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or (only is not None and f.name not in only):
            continue
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help", "") + (f" [default: {default}]" if default not in (None, False) else "")
        if kind is bool:
            parser.add_argument(f"--{f.name}", action="store_true", help=help_text)
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        parser.add_argument(f"--{f.name}", type=base, default=default, help=help_text, metavar=base.__name__.upper())


def _split_model_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull `--model.FIELD=VALUE` (or `--model.FIELD VALUE`) out of argv."""
    rest, overrides, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--model."):
            key, eq, value = arg[len("--model."):].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"{arg} needs a value, e.g. {arg}=4")
                value, i = argv[i + 1], i + 1
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _train(argv: list[str]) -> int:
    from meshlm.train.loop import TrainConfig, train

    from meshlm import distributed

    raw = list(argv)
    parser = _Parser(prog="meshlm train", description="Train a LLaMA-family model on a dp,fsdp,tp,sp device mesh.")
    _add_dataclass_flags(parser, TrainConfig)
    argv, overrides = _split_model_overrides(argv)
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()}, model_overrides=overrides)
    cfg.validate()
    cluster = distributed.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.peer_timeout)
    if cluster.multi_process and not distributed.is_worker():
        return distributed.supervise(["train", *raw], cluster)  # the work runs in a watched child
    train(cfg)
    return 0


def _convert(argv: list[str]) -> int:
    from meshlm.checkpoint import hf

    parser = _Parser(prog="meshlm convert", description="Hugging Face LLaMA weights in (--from_hf) or out (--to_hf).")
    parser.add_argument("--from_hf", metavar="DIR", help="a LlamaForCausalLM folder (config.json + *.safetensors) to import")
    parser.add_argument("--out", metavar="P", help="with --from_hf: the meshlm params folder to write")
    parser.add_argument("--to_hf", metavar="DIR", help="the Hugging Face folder to write (config.json + safetensors)")
    parser.add_argument("--checkpoint", metavar="P", help="with --to_hf: a params folder, a run's output_dir or a checkpoint")
    parser.add_argument("--step", type=int, help="with --to_hf: which training checkpoint step (default: newest)")
    parser.add_argument("--dtype", help="cast weights to float32, bfloat16 or float16 (default: keep)")
    args = parser.parse_args(argv)
    if bool(args.from_hf) == bool(args.to_hf):
        raise UsageError("give exactly one of --from_hf=DIR --out=P or --to_hf=DIR --checkpoint=P")
    if args.from_hf:
        if not args.out:
            raise UsageError("--from_hf needs --out=P, the folder to write")
        path = hf.convert_from_hf(args.from_hf, args.out, args.dtype)
    else:
        if not args.checkpoint:
            raise UsageError("--to_hf needs --checkpoint=P, what to convert")
        path = hf.convert_to_hf(args.checkpoint, args.to_hf, args.dtype, step=args.step)
    print(f"wrote {path}")
    return 0


def _export(argv: list[str]) -> int:
    from meshlm.checkpoint.export import export_params

    parser = _Parser(prog="meshlm export", description="Write a checkpoint's parameters only (for serving), in the compute dtype.")
    parser.add_argument("--checkpoint", metavar="D", required=True, help="a run's output_dir, its checkpoints/ or checkpoints/N")
    parser.add_argument("--out", metavar="P", required=True, help="the params folder to write")
    parser.add_argument("--step", type=int, help="which checkpoint step (default: newest)")
    parser.add_argument("--dtype", help="override the dtype (default: the model's compute dtype)")
    args = parser.parse_args(argv)
    print(f"wrote {export_params(args.checkpoint, args.out, args.dtype, args.step)}")
    return 0


def _generate(argv: list[str]) -> int:
    from meshlm.serve.cli import generate

    return generate(argv)


def _serve(argv: list[str]) -> int:
    from meshlm.serve.cli import serve

    return serve(argv)


def _explain(argv: list[str]) -> int:
    from meshlm.explain.cli import run

    return run(argv)


def _plan(argv: list[str]) -> int:
    from meshlm.plan.cli import run

    return run(argv)


COMMANDS = {"train": _train, "explain": _explain, "plan": _plan, "generate": _generate, "serve": _serve, "convert": _convert,
            "export": _export}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: meshlm {" + ",".join(COMMANDS) + "} [flags]   (meshlm COMMAND --help for the flags)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
