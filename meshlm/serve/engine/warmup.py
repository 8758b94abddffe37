"""Warm-up: which shapes the engine compiles before and while it serves, in what order, and a progress bar.

A shape is a tuple: ("prefill", P) is the prefill of prompts padded to P tokens, ("decode", rows,
length) a decode step of `rows` slots over `length` cache positions, ("score", rows, length) the
log-probability Scorer's forward over that many padded sequences (meshlm/serve/engine/scoring.py).

`plan` orders them by how soon traffic needs them: the shortest prefill bucket and the smallest decode
step first (one short request needs nothing else), then the other decode steps (short caches and few
rows before long caches and many rows) alternating with the longer prefill buckets, then the Scorer's
smallest bucket. `meshlm serve` compiles the first `FIRST` of them before it takes requests and the
rest in the background (meshlm/serve/engine/batching.py: `Engine.start(background=True)`).

`WarmupProgress` shows "shapes compiled / total" with the elapsed and remaining time on a rich console.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

import jax
import numpy as np

from meshlm.serve.engine.sampling import SlotSampling
from meshlm.serve.engine.shapes import Shapes

log = logging.getLogger("meshlm.serve")

BAR = 24  # the bar's width in characters
FIXED = 16 + BAR + 5 + 7 + 3 + 7 + 7  # the columns before the shape's name, and the spaces between them
FIRST = 2  # shapes compiled before a server takes requests: the shortest prefill and the smallest decode step


def plan(shapes: Shapes, score: tuple[int, int] | None = None) -> list[tuple]:
    """Every shape of `shapes` (and the Scorer's `score` = (rows, length) when given), most needed first."""
    prefill = [("prefill", n) for n in shapes.prefill_lengths]
    decode = sorted(
        (("decode", r, n) for r in shapes.decode_rows for n in shapes.decode_lengths), key=lambda s: (s[2], s[1])
    )
    rest = [s for pair in itertools.zip_longest(decode[1:], prefill[1:]) for s in pair if s is not None]
    return [prefill[0], decode[0], *rest] + ([("score", *score)] if score else [])


def run_padding(engine: Any, shape: tuple, publish: bool) -> None:
    """Run `shape` once on an engine's padding rows (it compiles the first time), no slot changing;
    `publish` it to the other processes. A Scorer shape that fails is logged: generation still works."""
    kind, *dims = shape
    link = engine._link if publish else None
    try:
        if kind == "prefill":
            Bp = engine.prefill_batch
            args = (
                np.zeros((Bp, dims[0]), np.int32),
                np.ones(Bp, np.int32),
                np.full(Bp, engine.max_batch, np.int32),
                SlotSampling.empty(Bp),
            )  # every row is padding
            if link is not None:
                link.prefill(*args)
            jax.block_until_ready(engine.steps.prefill(*args))
        elif kind == "decode":
            if link is not None:
                link.decode(*dims)
            jax.block_until_ready(engine.steps.decode(*dims))  # only idle slots: none busy during warm-up
        else:
            rows, length = dims
            engine.scorer().score([[0] * length] * rows)
    except Exception:  # noqa: BLE001  (a failed Scorer leaves generation working; its requests fail)
        if kind != "score":
            raise
        log.exception("warming the log-probability scorer failed")


def describe(shape: tuple) -> str:
    """A shape in words, for the progress bar."""
    kind, *dims = shape
    if kind == "prefill":
        return f"prefill of {dims[0]}-token prompts"
    if kind == "decode":
        return f"decode step, {dims[0]} row(s) × {dims[1]} cached tokens"
    return f"log-probabilities, {dims[0]} row(s) × {dims[1]} tokens"


class WarmupProgress:
    """A progress bar on a rich console: shapes compiled / total, elapsed and remaining time, the shape
    compiling now. Call it as the engine's `progress(done, total, compiling)` callback, from any thread;
    `close()` ends the bar early. Once every shape is compiled the bar ends and `on_done(seconds)` runs."""

    def __init__(self, console, on_done=None):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console, self.on_done = console, on_done
        self._progress = Progress(
            TextColumn("compiling shapes"),
            BarColumn(bar_width=BAR),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("[dim]{task.description}[/dim]"),
            console=console,
            transient=False,
        )
        self._task = None
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self.closed = False

    def __call__(self, done: int, total: int, compiling: tuple | None = None) -> None:
        with self._lock:
            if self.closed:
                return
            if self._task is None:
                self._progress.start()
                self._t0 = time.perf_counter()
                self._task = self._progress.add_task("", total=total)
            now = describe(compiling) if compiling is not None else ""
            room = self.console.width - FIXED  # a narrow terminal cuts the shape's name, not the counts
            now = now if len(now) <= room else now[: max(room - 1, 0)] + "…" * (room > 0)
            self._progress.update(self._task, completed=done, total=total, description=now)
            finished = done >= total
            if finished:
                self.closed = True
                self._progress.stop()
        if finished and self.on_done is not None:
            self.on_done(time.perf_counter() - self._t0)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                if self._task is not None:
                    self._progress.stop()


__all__ = ["FIRST", "plan", "run_padding", "describe", "WarmupProgress"]
