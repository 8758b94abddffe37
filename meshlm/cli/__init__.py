"""`meshlm <command> [flags]`: one module per command, each parsing its flags, calling the library
(the job layer in meshlm.job, then the command's own package) and printing.

Bad input never reaches JAX: it is a one-line `error: ...` naming the fix, and exit code 2.
"""

from __future__ import annotations

import importlib
import sys

from meshlm.errors import UsageError

# command -> (module in meshlm.cli, function, one line for `meshlm --help`)
COMMANDS = {
    "train": ("train", "run", "train a model on a dp,fsdp,tp,sp(,pp) mesh"),
    "explain": ("explain", "run", "show the layouts, memory and collectives of a strategy's train step"),
    "plan": ("plan", "run", "rank the meshes for a training job, and check the best by compiling"),
    "generate": ("serve", "generate", "stream a completion of one prompt to the terminal"),
    "serve": ("serve", "serve", "an OpenAI-compatible HTTP API and a chat page"),
    "eval": ("eval", "run", "lm-evaluation-harness tasks on a checkpoint, in-process on the mesh"),
    "convert": ("convert", "convert", "Hugging Face LLaMA weights in (--from_hf) or out (--to_hf)"),
    "export": ("convert", "export", "a checkpoint's parameters only, for serving"),
    "data": ("data", "run", "data prepare: tokenize a dataset in parallel into token shards, once"),
}


def version() -> str:
    """meshlm's installed version (the package metadata's), or "unknown" when run from an uninstalled tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("meshlm")
    except PackageNotFoundError:
        return "unknown"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {line}" for name, (_, _, line) in COMMANDS.items()]
    return (
        "usage: meshlm COMMAND [flags]   (meshlm COMMAND --help for its flags; meshlm --version)\n\ncommands:\n"
        + "\n".join(lines)
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"meshlm {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        from meshlm.cli.flags import did_you_mean

        hint = did_you_mean(command, COMMANDS, "meshlm ") or f"; choose one of {', '.join(COMMANDS)}"
        print(f"error: unknown command {command!r}{hint}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[command]
    from meshlm.platform import skip_absent_tpu

    skip_absent_tpu()  # before any command starts JAX
    try:
        return getattr(importlib.import_module(f"meshlm.cli.{module}"), function)(rest)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
