"""The first NaN/Inf loss, gradient norm or saved weights ends the run, the newest checkpoint kept."""

from __future__ import annotations

from pathlib import Path

from meshlm.train import report
from meshlm.train.diagnostics import NonFinite, NonFiniteWatch
from meshlm.train.hooks import Hook, StepEnd
from meshlm.train.hooks.checkpoints import CheckpointHook


class NanWatchHook(Hook):
    """Checked where the loop reads the device anyway: at log steps and before a save (then the weights
    too, so no checkpoint holds a step that went NaN)."""

    def __init__(self, watch: NonFiniteWatch, checkpoints: CheckpointHook, log_every: int, out: Path, console):
        self.watch, self.checkpoints, self.log_every, self.out, self.console = (
            watch,
            checkpoints,
            log_every,
            out,
            console,
        )
        self.diverged: NonFinite | None = None

    def after_step(self, end: StepEnd) -> bool:
        self.watch.observe(end.step, end.metrics, end.host_batch)  # on the device: no host sync
        saving = self.checkpoints.due(end.step)
        if not (saving or end.step % self.log_every == 0):
            return False
        self.diverged = self.watch.check(end.step, end.state.params if saving else None)
        if self.diverged is None:
            return False
        saved_at = self.checkpoints.saved_at
        self.console.print(report.diverged(self.diverged, saved_at if saved_at >= 1 else None, self.out))
        return True  # nothing more is saved: the newest checkpoint is the last good one
