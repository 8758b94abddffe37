"""The command-line parser every `meshlm` command uses, and flags built from `meshlm.config` sections.

parser = Parser(prog="meshlm train", description="...")
add_section_flags(parser, TrainConfig)                   # every section, one help group each
add_section_flags(parser, ClusterConfig, title="...")    # one section
argv, overrides = split_model_overrides(argv)            # --model.FIELD=VALUE
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from meshlm import config
from meshlm.errors import UsageError, closest
from meshlm.models import policy
from meshlm.models.configs import ModelConfig


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """` (did you mean PREFIX+CHOICE?)` for the closest choice to a misspelled `word`, or ''."""
    bare = {c.lstrip("-"): c for c in choices}
    close = closest(word.lstrip("-"), bare)
    return f"; did you mean {prefix}{bare[close]}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse whose own errors are one `UsageError` line naming `--help` (exit code 2 in `main`); an
    unknown flag close to a known one names it (`--mesh_dims`: did you mean --mesh_dim?). Flags are
    taken by their whole names only: argparse's prefix matching would read `--step=5` as `--steps`
    in `meshlm train` and as the checkpoint's `--step` in `meshlm generate`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see `meshlm {self.prog.split()[-1]} --help`)")

    def parse_args(self, args=None, namespace=None):
        flags = [o for o in self._option_string_actions if o.startswith("--")]
        for arg in args or ():  # before argparse, which would first name a required flag left out
            name = arg.split("=", 1)[0]
            if name.startswith("--") and len(name) > 2 and name not in flags:
                if hint := did_you_mean(name, flags):
                    self.error(f"unknown flag {name}{hint}")
        parsed = super().parse_args(args, namespace)
        self.given = frozenset(a[2:].split("=", 1)[0] for a in args or () if a.startswith("--"))
        return parsed


def add_dataclass_flags(
    parser,
    cls,
    only: tuple[str, ...] | None = None,
    defaults: dict | None = None,
    meaning: dict[str, str] | None = None,
) -> None:
    """A flag per field of `cls` (or only the fields named in `only`), with its help text and default.
    A command where a flag means something else passes its own `defaults` and help (`meaning`, taken
    whole, its default written in it) by field name."""
    hints = typing.get_type_hints(cls)
    defaults, meaning = defaults or {}, meaning or {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or (only is not None and f.name not in only):
            continue
        kind = hints[f.name]
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        help_text = meaning.get(f.name) or f.metadata.get("help", "") + (
            f" [default: {default}]" if default is not None and default is not False else ""
        )
        if kind is bool:
            parser.add_argument(f"--{f.name}", action="store_true", help=help_text)
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        parser.add_argument(f"--{f.name}", type=base, default=default, help=help_text, metavar=base.__name__.upper())


def add_section_flags(
    parser: argparse.ArgumentParser,
    cls=config.TrainConfig,
    title: str | None = None,
    only: tuple[str, ...] | None = None,
) -> None:
    """The flags of `cls`: a `meshlm.config` section (one help group), or `TrainConfig` (one group per
    section, in `config.SECTIONS` order)."""
    sections = list(config.SECTIONS.items()) if cls is config.TrainConfig else [(title, cls)]
    for name, section in sections:
        group = parser.add_argument_group(
            title if cls is not config.TrainConfig else name, (section.__doc__ or "").strip() or None
        )
        add_dataclass_flags(group, section, only)


def add_cluster_flags(parser: argparse.ArgumentParser, description: str | None = None) -> None:
    """`meshlm train`'s flags for several processes: the same names, help, defaults and checks."""
    group = parser.add_argument_group("several processes", description or config.ClusterConfig.__doc__.strip())
    add_dataclass_flags(group, config.ClusterConfig)


# Run policy fields that are `meshlm train` flags of their own (--dtype, --param_dtype, --remat, --attention):
# the flag is the one way to set them, so `--model.dtype=...` is refused rather than overridden by it.
TRAIN_FLAG_FIELDS = frozenset(policy.FIELDS) & frozenset(f.name for f in config.flag_fields())
# What `--model.FIELD` sets: the model's fields, and the run policy's that have no flag (`policy.OVERRIDES`).
MODEL_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig)) | frozenset(policy.OVERRIDES)


def split_model_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Pull `--model.FIELD=VALUE` (or `--model.FIELD VALUE`) out of argv."""
    rest, overrides, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--model."):
            key, eq, value = arg[len("--model.") :].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise UsageError(f"{arg} needs a value, e.g. {arg}=4")
                value, i = argv[i + 1], i + 1
            if key in TRAIN_FLAG_FIELDS:
                raise UsageError(f"--model.{key}: set it with --{key}={value or 'VALUE'} (a flag of its own)")
            if key not in MODEL_KEYS and (hint := did_you_mean(key, MODEL_KEYS, "--model.")):
                raise UsageError(f"--model.{key}: unknown model field{hint}")
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def train_config(
    args: argparse.Namespace, overrides: dict, drop: tuple[str, ...] = (), given: frozenset[str] = frozenset()
) -> config.TrainConfig:
    """A checked TrainConfig from parsed flags (leaving out the command's own flags in `drop`); `given`:
    the flags named on the command line (`Parser.given`), the rest were left at their defaults."""
    values = {k: v for k, v in vars(args).items() if k not in drop}
    cfg = config.TrainConfig(**values, model_overrides=overrides)
    cfg.given = given
    cfg.validate()
    return cfg
