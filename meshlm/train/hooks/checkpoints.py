"""Checkpoints: every `--save_every` steps, at the last step and when a stop is requested."""

from __future__ import annotations

from meshlm.checkpoint.manager import Checkpointer
from meshlm.train.hooks import Hook, StepEnd
from meshlm.train.state import checkpointed
from meshlm.train.trainable import Trainable


class CheckpointHook(Hook):
    def __init__(
        self,
        checkpointer: Checkpointer,
        trainable: Trainable,
        loader,
        meta: dict,
        stop,
        first_step: int,
        total_steps: int,
    ):
        self.checkpointer, self.trainable, self.loader, self.meta = checkpointer, trainable, loader, meta
        self.stop, self.total_steps = stop, total_steps
        self.saved_at = first_step - 1  # the newest step saved (the one the run started from)

    def due(self, step: int) -> bool:
        """Whether `step` is saved (asked again after the step's evaluation: a stop may arrive meanwhile)."""
        return bool(self.checkpointer.should_save(step) or self.stop.requested or step == self.total_steps)

    def after_step(self, end: StepEnd) -> bool:
        if self.due(end.step):
            self.checkpointer.save(end.step, checkpointed(end.state, self.trainable), self.loader.state(), self.meta)
            self.saved_at = end.step
        return False

    def finish(self) -> None:
        self.checkpointer.close()  # waits for the last asynchronous save
