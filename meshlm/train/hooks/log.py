"""The log phase: metrics.jsonl (and the tracker), the console's metrics line and progress, and the
throughput clock they read."""

from __future__ import annotations

import time

import jax

from meshlm.train.console import TrainProgress, print_metrics_line
from meshlm.train.hooks import Hook, StepEnd
from meshlm.train.metrics import MetricsLogger


class StepClock:
    """Tokens and seconds since the last log line; the compile's time and other pauses left out; the
    wait for each step's batch (`next_batch`) and the loader's own fields (a mixture's tokens per source)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step, self.tokens_since, self.t_last = tokens_per_step, 0, time.perf_counter()
        self.compile_seconds: float | None = None
        self.data_wait, self.batches_taken = 0.0, 0
        self.data_fields: dict = {}

    def next_batch(self, loader) -> dict:
        """The loader's next batch, the time waited for it counted."""
        t0 = time.perf_counter()
        batch = next(loader)
        self.data_wait += time.perf_counter() - t0
        self.batches_taken += 1
        self.data_fields = loader.log_fields() if hasattr(loader, "log_fields") else {}
        return batch

    def take_data_metrics(self) -> dict:
        """`data_wait_ms` (the mean wait per step since the last call) and the loader's fields."""
        wait = 1e3 * self.data_wait / self.batches_taken if self.batches_taken else 0.0
        self.data_wait, self.batches_taken = 0.0, 0
        return {"data_wait_ms": wait, **self.data_fields}

    def restart(self) -> None:
        self.t_last, self.tokens_since = time.perf_counter(), 0

    def leave_out(self, seconds: float) -> None:
        """Time spent off the train steps (an evaluation): not counted in tok/s."""
        self.t_last += seconds


class LogHook(Hook):
    def __init__(
        self,
        logger: MetricsLogger,
        progress: TrainProgress,
        clock: StepClock,
        log_every: int,
        total_steps: int,
        console,
        is_main: bool,
    ):
        self.logger, self.progress, self.clock, self.console, self.is_main = logger, progress, clock, console, is_main
        self.log_every, self.total_steps = log_every, total_steps
        self.history: list[dict] = []

    def after_step(self, end: StepEnd) -> bool:
        if end.step % self.log_every != 0 and end.step != self.total_steps:
            self.progress.update(end.step, None)
            return False
        clock = self.clock
        host = jax.device_get(end.metrics)  # the only host sync: once per log step
        now = time.perf_counter()
        row = self.logger.log(  # the first step's time is the compile: its throughput is honest, not useful
            end.step,
            loss=float(host["loss"]),
            tokens=clock.tokens_per_step if end.first else clock.tokens_since,
            seconds=clock.compile_seconds if end.first else max(now - clock.t_last, 1e-9),
            extra={
                "lr": float(host.get("lr", 0.0)),
                "grad_norm": float(host["grad_norm"]),
                **clock.take_data_metrics(),
            },
        )
        self.history.append(row)
        if self.is_main:
            print_metrics_line(row, console=self.console)
        clock.t_last, clock.tokens_since = now, 0
        self.progress.update(end.step, row)
        return False
