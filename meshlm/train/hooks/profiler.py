"""A profiler trace of `--profile_steps`, its start and its file announced."""

from __future__ import annotations

from meshlm.train.diagnostics import StepProfiler
from meshlm.train.hooks import Hook, StepEnd


class ProfilerHook(Hook):
    def __init__(self, profiler: StepProfiler, first_step: int, console):
        self.profiler, self.first_step, self.console = profiler, first_step, console

    def _say(self, line: str | None) -> None:
        if line:
            self.console.print(line)

    def before_step(self, step: int, host_batch: dict) -> None:
        self._say(self.profiler.before(step, self.first_step))

    def after_step(self, end: StepEnd) -> bool:
        self._say(self.profiler.after(end.step, end.state))
        return False

    def finish(self) -> None:
        self._say(self.profiler.close())
