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


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
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

    parser = _Parser(prog="meshlm train", description="Train a LLaMA-family model on a dp,fsdp,tp,sp device mesh.")
    _add_dataclass_flags(parser, TrainConfig)
    argv, overrides = _split_model_overrides(argv)
    args = parser.parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()}, model_overrides=overrides)
    train(cfg)
    return 0


COMMANDS = {"train": _train}


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
