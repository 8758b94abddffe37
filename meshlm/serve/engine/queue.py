"""The engine's work not started yet: prompts waiting for a slot, and sequences waiting to be scored.

Prompts are kept by submission (one `Engine.submit`, or a whole `submit_batch`). A free slot goes to
the submission holding the fewest slots, the one waiting longest among equals: a batch of many prompts
takes free slots in turn with the requests that came after it, never all of them while others wait.
Scoring requests take turns a chunk at a time. At most `max_queue` prompts and sequences wait at once
(None: no limit); past that, adding raises `QueueFull`.

Not thread-safe: the engine holds its lock around every call.
"""

from __future__ import annotations

import collections

from meshlm.serve.engine.limits import QueueFull
from meshlm.serve.engine.request import RequestHandle, ScoreHandle


class WorkQueue:
    def __init__(self, max_queue: int | None = None):
        self.max_queue = max_queue
        self._prompts: dict[int, collections.deque[RequestHandle]] = {}  # by submission, oldest first
        self._scoring: collections.deque[ScoreHandle] = collections.deque()  # taking turns, a chunk each

    def __bool__(self) -> bool:
        return bool(self._prompts or self._scoring)

    def __len__(self) -> int:
        """Prompts waiting for a slot and sequences waiting to be scored."""
        return sum(map(len, self._prompts.values())) + sum(h.remaining() for h in self._scoring)

    def add_prompts(self, handles: list[RequestHandle]) -> None:
        """One submission's requests, all of them or (QueueFull) none."""
        self._check_room(len(handles))
        self._prompts[handles[0].group] = collections.deque(handles)

    def add_scores(self, handle: ScoreHandle, *, check: bool = True) -> None:
        if check:
            self._check_room(handle.remaining())
        self._scoring.append(handle)

    def _check_room(self, n: int) -> None:
        if self.max_queue is not None and (waiting := len(self)) + n > self.max_queue:
            raise QueueFull(
                f"the server is busy: {waiting} prompts are waiting and this request brings {n}, over "
                f"the queue's {self.max_queue} (--max_queue); retry in a moment"
            )

    def take_prompts(self, n: int, held: collections.Counter) -> tuple[list[RequestHandle], list[RequestHandle]]:
        """(up to `n` requests for free slots, fairly given `held`: slots per submission; the cancelled
        requests removed on the way, for the engine to finish)."""
        cancelled = []
        for key, queue in list(self._prompts.items()):
            if any(h.cancelled for h in queue):
                cancelled += [h for h in queue if h.cancelled]
                queue = self._prompts[key] = collections.deque(h for h in queue if not h.cancelled)
            if not queue:
                del self._prompts[key]
        held, taken = collections.Counter(held), []
        while self._prompts and len(taken) < n:
            key = min(self._prompts, key=lambda k: held[k])  # the first of equals: the oldest
            taken.append(self._prompts[key].popleft())
            held[key] += 1
            if not self._prompts[key]:
                del self._prompts[key]
        return taken, cancelled

    def next_chunk(self) -> tuple[ScoreHandle | None, list[int], list[ScoreHandle]]:
        """(the scoring request whose turn it is, or None, and the indices of its next chunk; the
        cancelled scoring requests removed, for the engine to finish)."""
        cancelled = [h for h in self._scoring if h.cancelled]
        for h in cancelled:
            self._scoring.remove(h)
        if not self._scoring:
            return None, [], cancelled
        h = self._scoring.popleft()
        chunk = h.chunks.popleft()
        if h.chunks:
            self._scoring.append(h)  # the next request's turn
        return h, chunk, cancelled

    def drop(self, handle: ScoreHandle) -> None:
        """A scoring request that failed: no more of its chunks."""
        if handle in self._scoring:
            self._scoring.remove(handle)

    def drain(self) -> tuple[list[RequestHandle], list[ScoreHandle]]:
        """Everything still waiting, removed (the engine is stopping)."""
        prompts = [h for queue in self._prompts.values() for h in queue]
        scoring = list(self._scoring)
        self._prompts.clear()
        self._scoring.clear()
        return prompts, scoring


__all__ = ["WorkQueue"]
