"""The training loop's hooks: each one watches or records one thing around every step (`Hook`).

Before a step: `DocumentsHook`, `ProfilerHook`. After it, in this order: `LogHook` (metrics files, the
tracker, the console line and progress), `ProfilerHook`, `NanWatchHook` (ends the run at a NaN/Inf),
`EvaluationHook`, `CheckpointHook`. `finish` runs once the loop is over.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What a finished step hands its hooks."""

    step: int
    state: Any  # the train state after the step
    metrics: dict  # the step's metrics, still on the device
    host_batch: dict  # the step's rows on the host
    first: bool  # the run's first step: its time is the compile


class Hook:
    def before_step(self, step: int, host_batch: dict) -> None:
        """Called with the step's host batch, before the step runs."""

    def after_step(self, end: StepEnd) -> bool:
        """Called after the step; True ends the run there (nothing more is saved)."""
        return False

    def finish(self) -> None:
        """Called once after the loop."""


__all__ = ["Hook", "StepEnd"]
