"""Batches read ahead on a background thread: while step s trains, steps s+1 .. s+depth are read.

`Prefetcher(produce, depth)` calls `produce(step)` (a pure function of the step, such as
`DataLoader.batch`) on its own thread into a bounded queue. `get(step)` returns batch `step`: the next
one queued, or, when asked for another step than the one queued next (a restore), it stops the thread
and starts reading again from that step. An error raised while reading is raised again in the thread
that calls `get`, with its message. `close()` stops the thread; it holds its loader weakly, so a
loader dropped without `close()` stops it too, and it is a daemon, so a run still exits.
"""

from __future__ import annotations

import inspect
import queue
import threading
import weakref
from collections.abc import Callable

DEFAULT_DEPTH = 3
_POLL_S = 0.1  # how often a blocked producer checks whether it was stopped


class Prefetcher:
    def __init__(self, produce: Callable[[int], dict], depth: int = DEFAULT_DEPTH):
        if depth < 1:
            raise ValueError(f"prefetch depth {depth} must be >= 1")
        # a bound method is held weakly: the thread must not keep its loader alive
        self._produce = weakref.WeakMethod(produce) if inspect.ismethod(produce) else (lambda: produce)
        self.depth = depth
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._next = -1  # the step the queue's head holds (-1: not started)

    def get(self, step: int) -> dict:
        """Batch `step`, waiting for it if it is not read yet."""
        if self._thread is None or step != self._next:
            self._start(step)
        while True:
            try:
                got_step, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data prefetch thread stopped without a batch") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._next = got_step + 1
        return item

    def _start(self, step: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._next = step
        self._thread = threading.Thread(
            target=self._run, args=(step, self._stop, self._queue), name="meshlm-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, step: int, stop: threading.Event, out: queue.Queue) -> None:
        while not stop.is_set():
            produce = self._produce()
            if produce is None:  # the loader is gone
                return
            try:
                item = produce(step)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread, raised there
                item = e
            del produce
            while not stop.is_set() and self._produce() is not None:
                try:
                    out.put((step, item), timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            step += 1

    def close(self) -> None:
        """Stop reading ahead and wait for the thread to finish (at most one batch's read)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread, self._next = None, -1

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class ReadsAhead:
    """Iteration for a loader with `batch(step)`, `step` and `prefetch` (depth; 0 reads in place):
    `next()` gives the batch at `step` and advances; `close()` (or leaving a `with`) stops the thread."""

    step: int
    prefetch: int
    _prefetcher: Prefetcher | None = None

    def batch(self, step: int) -> dict:
        raise NotImplementedError

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.prefetch > 0:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self.batch, self.prefetch)
            batch = self._prefetcher.get(self.step)
        else:
            batch = self.batch(self.step)
        self.step += 1
        return batch

    def close(self) -> None:
        """Stop reading ahead (`next` starts again where the loader is)."""
        if self._prefetcher is not None:
            self._prefetcher.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
