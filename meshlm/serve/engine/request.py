"""What a caller hands the generation engine and what it gets back.

A `GenerationRequest` (prompt token ids, how many tokens, sampling settings, stop strings) goes in;
`Engine.submit` returns a `RequestHandle`, whose `Event`s (text pieces, then one with a finish reason)
can be read from a thread (`iter_sync`, `result`) or from asyncio (`async for`). Sequences to score
go in through `Engine.submit_scores`, which returns a `ScoreHandle`: the `Scores` of every sequence
once the engine has scored them all (`result`, or `await handle.wait()`).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field

from meshlm.serve.engine.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep going past the end-of-text token (benchmarks)


@dataclass(frozen=True)
class Event:
    """A piece of a streamed reply. The last event has `finish_reason`: "stop" (end-of-text token or a
    stop string), "length" (max_tokens or the context is full), "cancelled" or "error"."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


class RequestHandle:
    """What `Engine.submit` returns: iterate its events from a thread or from asyncio."""

    def __init__(self, request: GenerationRequest, request_id: int, group: int | None = None):
        self.request = request
        self.id = request_id
        self.group = request_id if group is None else group  # the requests submitted together share it
        self.prompt_tokens = len(request.prompt_ids)
        self.completion_tokens = 0
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None
        self.cancelled = False
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: collections.deque[Event] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue | None = None
        # decoding state, touched only by the engine thread
        self._ids: list[int] = []
        self._text = None  # meshlm.serve.engine.text.IncrementalText, set by the engine
        self._stops = None  # meshlm.serve.engine.text.StopMatcher, set by the engine
        self._held = ""  # settled text not sent yet: it could begin a stop string

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop generating; the slot is freed at the next step boundary."""
        self.cancelled = True

    def _push(self, event: Event) -> None:
        with self._lock:
            if self._loop is None:
                self._events.append(event)
                self._ready.notify_all()
                return
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                self.cancelled = True

    def iter_sync(self, timeout: float | None = None):
        """Events as they come, blocking the calling thread."""
        while True:
            with self._ready:
                if not self._events and not self._ready.wait_for(lambda: self._events, timeout):
                    raise TimeoutError(f"request {self.id}: no event within {timeout} s")
                event = self._events.popleft()
            yield event
            if event.finish_reason is not None:
                return

    async def _aiter(self):
        with self._lock:
            self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()
            while self._events:
                self._queue.put_nowait(self._events.popleft())
        while True:
            event = await self._queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def __aiter__(self):
        return self._aiter()

    def result(self, timeout: float | None = None) -> tuple[str, str]:
        """(whole text, finish reason), blocking."""
        text, reason = [], None
        for event in self.iter_sync(timeout):
            text.append(event.text)
            reason = event.finish_reason
        return "".join(text), reason


class ScoreHandle:
    """What `Engine.submit_scores` returns. The engine scores the sequences a chunk at a time, between
    its decode steps; `finish_reason` is then "scored" (`scores` holds every sequence's `Scores`, in
    order), "cancelled" or "error"."""

    def __init__(self, sequences: list[list[int]], top: int, request_id: int, chunks: list[list[int]]):
        self.sequences, self.top, self.id = sequences, top, request_id
        self.scores: list = [None] * len(sequences)
        self.chunks = collections.deque(chunks)  # indices of the sequences still to score, a chunk each
        self.finish_reason: str | None = None
        self.cancelled = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def remaining(self) -> int:
        """Sequences not scored yet."""
        return sum(map(len, self.chunks))

    def cancel(self) -> None:
        """Score no more of it; the engine drops its remaining chunks before its next one."""
        self.cancelled = True

    def _finish(self, reason: str) -> None:
        with self._lock:
            self.finish_reason = reason
            waiters, self._waiters = self._waiters, []
        self._done.set()
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass

    def result(self, timeout: float | None = None) -> list:
        """Every sequence's `Scores`, blocking; RuntimeError if the engine ended it unscored."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"scoring {self.id}: not done within {timeout} s")
        if self.finish_reason != "scored":
            raise RuntimeError(f"scoring {self.id} ended: {self.finish_reason}")
        return self.scores

    async def wait(self) -> str:
        """Wait for the engine to finish it, without blocking the event loop: the finish reason."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.finish_reason is not None:
                return self.finish_reason
            future = loop.create_future()
            self._waiters.append((loop, future))
        await future
        return self.finish_reason


def _resolve(future: asyncio.Future) -> None:
    if not future.done():  # a waiter that was cancelled (its client hung up) is past caring
        future.set_result(None)


__all__ = ["GenerationRequest", "Event", "RequestHandle", "ScoreHandle"]
