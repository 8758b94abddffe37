"""`TrainConfig`: one run's settings, each section of `meshlm.config.sections` a field of it.

cfg = TrainConfig(model="tiny", batch_size=16)   # flags by name, each set on its section
cfg.batch.batch_size, cfg.batch_size             # the same value: a flag reads through to its section
cfg.validate()                                   # every section's check, once per set of values
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshlm.config.sections import (
    SECTIONS,
    BatchConfig,
    ChatDataConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    MeshConfig,
    ModelSection,
    OptimizerSection,
    PipelineConfig,
    PrecisionConfig,
    TrackingConfig,
)

# Help-group title (`SECTIONS`) -> the attribute of `TrainConfig` that holds the section.
ATTRIBUTES = {
    "mesh": "mesh",
    "cluster": "cluster",
    "model": "source",
    "pipeline": "pipeline",
    "batch": "batch",
    "precision": "precision",
    "optimizer": "optimizer",
    "lora": "lora",
    "data": "data",
    "finetune data": "finetune",
    "eval": "eval",
    "checkpoint": "checkpoint",
    "logging": "logging",
    "tracking": "tracking",
}


def flag_fields() -> list[dataclasses.Field]:
    """Every section's fields, in `SECTIONS` order (the flags are those without `cli=False`)."""
    return [f for cls in SECTIONS.values() for f in dataclasses.fields(cls)]


def _public_names(cls) -> list[str]:
    """A section's fields and properties: what `TrainConfig` reads through to it."""
    properties = [n for n, v in vars(cls).items() if isinstance(v, property)]
    return [f.name for f in dataclasses.fields(cls)] + properties


# Flag (or section property) -> the attribute of the section that holds it.
OWNER = {name: ATTRIBUTES[title] for title, cls in SECTIONS.items() for name in _public_names(cls)}
assert not set(OWNER) & set(ATTRIBUTES.values()), "a section's attribute shadows a flag"


@dataclass(init=False)
class TrainConfig:
    """Every `meshlm train` flag, in its section. Built from flags by name (`TrainConfig(seq_len=64)`) or
    from sections (`TrainConfig(batch=BatchConfig(...))`, copied); `cfg.FLAG` reads and sets the flag in
    its section."""

    mesh: MeshConfig
    cluster: ClusterConfig
    source: ModelSection
    pipeline: PipelineConfig
    batch: BatchConfig
    precision: PrecisionConfig
    optimizer: OptimizerSection
    lora: LoraConfig
    data: DataConfig
    finetune: ChatDataConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    tracking: TrackingConfig

    def __init__(self, **values: Any):
        for title, cls in SECTIONS.items():
            section = values.pop(ATTRIBUTES[title], None)
            object.__setattr__(self, ATTRIBUTES[title], dataclasses.replace(section) if section is not None else cls())
        for name, value in values.items():
            if name not in OWNER:
                raise TypeError(f"TrainConfig() got an unexpected keyword argument {name!r}")
            setattr(self, name, value)
        object.__setattr__(self, "_checked", None)
        # The flags named (on the command line, or here by keyword), as against left at their defaults.
        object.__setattr__(self, "given", frozenset(values))

    def __getattr__(self, name: str):
        section = self.__dict__.get(OWNER.get(name, ""))  # absent while a copy is being restored
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(section, name)

    def __setattr__(self, name: str, value) -> None:
        if name in OWNER:
            setattr(self.__dict__[OWNER[name]], name, value)
        else:
            object.__setattr__(self, name, value)

    def sections(self) -> list[tuple[str, Any]]:
        """(help-group title, section) in `SECTIONS` order."""
        return [(title, getattr(self, ATTRIBUTES[title])) for title in SECTIONS]

    def section(self, name: str):
        """One section by its help-group title, e.g. `cfg.section("precision").dtype`."""
        return getattr(self, ATTRIBUTES[name])

    def as_flags(self) -> dict[str, Any]:
        """Every field by its flag name, one flat dict (the run folder's config.json keeps this form)."""
        return {k: v for _, section in self.sections() for k, v in dataclasses.asdict(section).items()}

    def validate(self) -> None:
        """Each section's checks, in order; the first problem is one `UsageError` line. Values already
        checked are not checked again (the CLI, the job and the trainer each ask)."""
        values = self.as_flags()
        if values == self._checked:
            return
        for _, section in self.sections():
            section.check(self)
        object.__setattr__(self, "_checked", values)
