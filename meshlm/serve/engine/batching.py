"""The generation engine: prefill and decode with a KV cache on the mesh, continuous batching.

    model, job = load_model("outputs/run")            # meshlm.serve.loading
    engine = Engine(model, max_batch=16)
    engine.start()                                    # compiles every shape it will ever run
    handle = engine.submit(GenerationRequest(prompt_ids, max_tokens=64, sampling=SamplingParams(0.7)))
    for event in handle.iter_sync():                  # or: async for event in handle
        print(event.text, end="")

The engine owns `max_batch` slots (rows of the KV cache, meshlm/serve/engine/steps.py); a loop on
its own thread admits waiting requests into free slots (one prefill), advances the busy slots by one
decode step, delivers the previous step's tokens as text and runs one chunk of log-probability
requests, again and again. At most `max_queue` prompts wait (`submit` past that raises `QueueFull`).
How it runs, compiles its shapes and follows process 0 across processes: docs/serve.md, "Inside the
server".
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import random
import threading
import time
from typing import Any

import jax
import numpy as np

from meshlm import sharding
from meshlm.serve.engine.limits import MAX_LOGPROBS, MAX_REQUEST_TOKENS, SCORE_CHUNK_TOKENS, QueueFull
from meshlm.serve.engine.queue import WorkQueue
from meshlm.serve.engine.request import Event, GenerationRequest, RequestHandle, ScoreHandle
from meshlm.serve.engine.sampling import SamplingParams, SlotSampling
from meshlm.serve.engine.shapes import plan_shapes
from meshlm.serve.engine.steps import Steps
from meshlm.serve.engine.text import IncrementalText, StopMatcher
from meshlm.serve.engine.warmup import plan, run_padding

log = logging.getLogger("meshlm.serve")


class Engine:
    """Continuous-batching generation for one model on one mesh. Thread-safe `submit`.

    `model` is a loaded model (meshlm.serve.loading.LoadedModel: cfg, placement, params, tokenizer,
    name, chat_template); the engine takes its weights over. `warm_scorer`: warm-up also compiles the
    log-probability Scorer's smallest bucket (never across processes, where it is not available)."""

    def __init__(
        self,
        model: Any,
        *,
        max_batch: int = 8,
        max_seq_len: int | None = None,
        prefill_buckets: tuple[int, ...] | None = None,
        prefill_batch: int | None = None,
        link=None,
        warm_scorer: bool = True,
        max_queue: int | None = None,
        max_request_tokens: int = MAX_REQUEST_TOKENS,
        max_logprobs: int = MAX_LOGPROBS,
        score_chunk_tokens: int = SCORE_CHUNK_TOKENS,
    ):
        placement = model.placement
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        self.chat_template = model.chat_template
        self.mesh = placement.mesh
        self.shapes = plan_shapes(
            model.cfg.max_seq_len,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            prefill_buckets=prefill_buckets,
            prefill_batch=prefill_batch,
            data=sharding.data_parallel_size(self.mesh, placement.strategy),
            sp=sharding.sequence_parallel_size(self.mesh, placement.strategy),
        )
        self.max_batch, self.max_seq_len = self.shapes.max_batch, self.shapes.max_seq_len
        self.buckets, self.prefill_batch = self.shapes.prefill_lengths, self.shapes.prefill_batch
        self.decode_rows, self.decode_lengths = self.shapes.decode_rows, self.shapes.decode_lengths
        self.eos_id = getattr(self.tokenizer, "eos_id", None)
        self.steps = Steps(model, self.max_batch, self.max_seq_len)

        self._slots: list[RequestHandle | None] = [None] * self.max_batch
        self._next_position = [0] * self.max_batch  # of each slot's next decode step, as dispatched
        self.queue = WorkQueue(max_queue)  # prompts and sequences to score; its `max_queue` may be changed
        self.max_request_tokens, self.max_logprobs = max_request_tokens, max_logprobs
        self.score_chunk_tokens = score_chunk_tokens
        self._wake = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seed_rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.stats = collections.Counter()
        self._link = link  # multihost.Leader in process 0, Follower elsewhere; None for one process
        self._scorer = None
        score = (
            None
            if link is not None or not warm_scorer
            else (sharding.data_parallel_size(self.mesh, placement.strategy), min(32, self.max_seq_len))
        )  # the Scorer's smallest bucket
        self._plan = plan(self.shapes, score)  # every shape to compile, most needed first
        self._compiled: set[tuple] = set()  # the shapes of the plan compiled so far
        self._background = False  # the loop compiles the shapes still missing when idle
        self._progress = None  # its progress(done, total, compiling)

    # --------------------------------------------------------------------------- public API

    def compiled_shapes(self) -> int:
        """How many shapes are compiled (prefill buckets + decode buckets): constant after `start()`."""
        return self.steps.compiled_shapes()

    def scorer(self):
        """The `meshlm.serve.engine.scoring.Scorer` over this engine's weights (made on first use, then shared).
        ValueError across several processes: the others would not run its forward."""
        if self._link is not None:
            raise ValueError("log-probabilities are not available when serving across several processes")
        with self._wake:
            if self._scorer is None:
                from meshlm.serve.engine.scoring import Scorer

                self._scorer = Scorer.from_engine(self)
            return self._scorer

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError if this request can never run here (before it is queued)."""
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if not isinstance(request.max_tokens, int) or request.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        if n > self.buckets[-1]:
            raise ValueError(
                f"the prompt has {n} tokens but the longest prompt this server takes is {self.buckets[-1]}"
            )
        if n + request.max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context of "
                f"{self.max_seq_len} tokens; shorten the prompt or lower max_tokens to "
                f"{max(self.max_seq_len - n, 0)}"
            )
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; its events stream from the returned handle. Thread-safe, never blocks.
        QueueFull when `max_queue` prompts are waiting already."""
        return self.submit_batch([request])[0]

    def submit_batch(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue requests together (all or, QueueFull, none): they share slots fairly with other
        submissions, as one submission (meshlm/serve/engine/queue.py)."""
        for request in requests:
            self.check(request)
        ids = [next(self._ids) for _ in requests]
        handles = [RequestHandle(r, i, group=ids[0]) for r, i in zip(requests, ids)]
        for h in handles:
            h._text, h._stops = IncrementalText(self.tokenizer), StopMatcher(h.request.stop)
        with self._wake:
            self.queue.add_prompts(handles)
            self._wake.notify()
        return handles

    def submit_scores(self, sequences: list[list[int]], top: int = 0, *, queue: bool = True) -> ScoreHandle:
        """Queue token sequences to score (meshlm.serve.engine.scoring.Scorer.score's arguments); the loop
        scores them a chunk at a time between decode steps. ValueError for sequences the Scorer cannot
        take; QueueFull as for `submit`, unless `queue` is False (work that must finish, such as the
        log-probabilities of a reply already generated)."""
        scorer = self.scorer()
        if not 0 <= top <= scorer.top:
            raise ValueError(f"top must be in [0, {scorer.top}], got {top}")
        scorer.check(sequences)
        sequences = [list(map(int, s)) for s in sequences]
        handle = ScoreHandle(sequences, top, next(self._ids), scorer.chunks(sequences, self.score_chunk_tokens))
        with self._wake:
            self.queue.add_scores(handle, check=queue)
            self._wake.notify()
        return handle

    def generate(self, prompt: str, max_tokens: int = 16, **sampling) -> str:
        """Convenience: the text generated for `prompt`, blocking."""
        ids = self.tokenizer.encode(prompt)
        return self.submit(GenerationRequest(ids, max_tokens, SamplingParams(**sampling))).result()[0]

    def start(self, warmup: bool = True, *, background: bool = False, progress=None) -> Engine:
        """Start the loop. `warmup`: compile every shape first. `background`: start at once and let the
        loop compile the shapes still missing while it is idle (`progress` as for `warmup`)."""
        if warmup and not background:
            self.warmup(progress)
        self._background, self._progress = background, (progress if background else None)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="meshlm-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._link is not None and not self._link.stopped:
            self._link.stop()  # the followers leave `follow()`; then this process's last steps finish
            self.steps.wait()

    def follow(self) -> None:
        """Process k > 0 of several: run the steps process 0 publishes, in order, until it stops.
        SIGINT/SIGTERM here wait for process 0's stop (multihost.signals_wait_for_leader)."""
        from meshlm.serve.engine.multihost import signals_wait_for_leader

        with signals_wait_for_leader(self._link):
            self._follow()
        self.steps.wait()

    def _follow(self) -> None:
        while True:
            step = self._link.receive()
            if step.kind == "stop":
                break
            if step.kind == "prefill":
                self.steps.prefill(*step.args)
                self.stats["prefills"] += 1
            else:
                self.steps.decode(*step.args)
                self.stats["decode_steps"] += 1

    def warmup(self, progress=None, *, count: int | None = None) -> float:
        """Compile the shapes not compiled yet, the most needed first (meshlm/serve/engine/warmup.py): all of
        them, or the next `count`. Runs padding rows only, so no slot changes. `progress(done, total,
        compiling)` is called before each shape and once after the last. Before `start()` only. Seconds taken."""
        t0 = time.perf_counter()
        for shape in self.uncompiled()[:count]:
            self._compile(shape, progress, publish=False)
        if progress is not None:
            progress(*self.warmed(), None)
        seconds = time.perf_counter() - t0
        log.info(
            "compiled %d of %d shapes (prefill buckets %s, decode steps for %s rows × %s cache slots) in %.1f s",
            *self.warmed(),
            self.buckets,
            self.decode_rows,
            self.decode_lengths,
            seconds,
        )
        return seconds

    def warmed(self) -> tuple[int, int]:
        """(shapes compiled, shapes in all): equal once warm-up is over."""
        return len(self._compiled), len(self._plan)

    def uncompiled(self) -> list[tuple]:
        """The shapes still to compile, in the order they will be (meshlm/serve/engine/warmup.py)."""
        return [s for s in self._plan if s not in self._compiled]

    def _compile(self, shape: tuple, progress, publish: bool) -> None:
        """Run `shape` once on padding rows (it compiles the first time); `publish` it to the other processes."""
        if progress is not None:
            progress(*self.warmed(), shape)
        run_padding(self, shape, publish)
        self._compiled.add(shape)

    def _ran(self, shape: tuple) -> None:
        """A request's step of `shape` ran (compiling it if warm-up had not yet): it needs no warm-up."""
        if shape not in self._compiled:
            self._compiled.add(shape)
            if self._progress is not None:
                self._progress(*self.warmed(), None)

    def _warm_next(self) -> None:
        """The loop has nothing to run: compile the next shape still missing."""
        shape = self.uncompiled()[0]
        try:
            self._compile(shape, self._progress, publish=True)
        except Exception as e:  # noqa: BLE001
            if self._link is not None:
                from meshlm import distributed

                distributed.fail_fast(e)
            log.exception("compiling %s failed; requests of that shape will compile it", shape)
            self._compiled.add(shape)  # not again: warm-up must end
        if self._progress is not None and not self.uncompiled():
            self._progress(*self.warmed(), None)

    # ---------------------------------------------------------------------------- the loop

    def _run(self) -> None:
        pending = None  # (tokens on device, owner of each slot when that step was dispatched)
        while True:
            with self._wake:
                idle = lambda: not self.queue and pending is None and not any(self._slots)  # noqa: E731, B023  (called in this iteration only)
                while not self._stopping and idle() and not (self._background and self.uncompiled()):
                    self._wake.wait()
                if self._stopping:
                    break
                warm = idle()  # so shapes remain
            if warm:
                self._warm_next()
                continue
            try:
                self._admit()
                if any(h is not None for h in self._slots):
                    shape = self._decode_shape()
                    if self._link is not None:
                        self._link.decode(*shape)
                    tokens = self.steps.decode(*shape)
                    self._ran(("decode", *shape))
                    self.stats["decode_steps"] += 1
                    for i, h in enumerate(self._slots):
                        if h is not None:
                            self._next_position[i] += 1
                    dispatched = (tokens, list(self._slots))
                else:
                    dispatched = None
                if pending is not None:
                    self._deliver(*pending)
                pending = dispatched
            except Exception as e:  # noqa: BLE001  (keep serving: fail only the requests in flight)
                if self._link is not None:  # the processes may no longer run the same steps: stop them all
                    from meshlm import distributed

                    distributed.fail_fast(e)
                log.exception("engine step failed")
                for i, h in enumerate(self._slots):
                    if h is not None:
                        self._finish(h, "error", text=f"[error: {type(e).__name__}]")
                        self._slots[i] = None
                pending = None
            self._score_next()
        with self._wake:
            waiting, scoring = self.queue.drain()
        for h in [*self._slots, *waiting]:
            if h is not None and not h.done:
                self._finish(h, "cancelled")
        for s in scoring:
            s._finish("cancelled")

    def _decode_shape(self) -> tuple[int, int]:
        """The smallest compiled (rows, length) that holds every busy slot and the positions it writes."""
        busy = [i for i, h in enumerate(self._slots) if h is not None]
        return self.shapes.decode_shape(busy[-1], max(self._next_position[i] for i in busy) + 1)

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, a group of up to `prefill_batch` at a time."""
        while True:
            with self._wake:
                free = [i for i, h in enumerate(self._slots) if h is None]
                held = collections.Counter(h.group for h in self._slots if h is not None)
                group, cancelled = self.queue.take_prompts(min(len(free), self.prefill_batch), held)
                for h in cancelled:
                    self._finish(h, "cancelled")
            if not group:
                return
            self._prefill_group(group, free[: len(group)])

    def _score_next(self) -> None:
        """Score one chunk of the scoring request whose turn it is (finishing cancelled ones first)."""
        with self._wake:
            h, chunk, cancelled = self.queue.next_chunk()
        for c in cancelled:
            c._finish("cancelled")
        if h is None:
            return
        try:
            shape = self._scorer.score_into(h, chunk)
        except Exception:  # noqa: BLE001  (fail this request only; generation goes on)
            log.exception("scoring failed")
            with self._wake:
                self.queue.drop(h)
            h._finish("error")
            return
        self.stats["score_chunks"] += 1
        if shape in self._plan:
            self._ran(shape)

    def _prefill_group(self, group: list[RequestHandle], slots: list[int]) -> None:
        Bp = self.prefill_batch
        P = self.shapes.prefill_length(max(h.prompt_tokens for h in group))
        tokens = np.zeros((Bp, P), np.int32)
        lengths = np.ones(Bp, np.int32)
        slot_ids = np.full(Bp, self.max_batch, np.int32)
        for row, (h, slot) in enumerate(zip(group, slots)):
            tokens[row, : h.prompt_tokens] = h.request.prompt_ids
            lengths[row], slot_ids[row] = h.prompt_tokens, slot
        params = [h.request.sampling for h in group] + [SamplingParams(temperature=0.0)] * (Bp - len(group))
        settings = SlotSampling.host(params, [self._seed_rng.getrandbits(32) for _ in params])
        if self._link is not None:
            self._link.prefill(tokens, lengths, slot_ids, settings)
        first = np.asarray(self.steps.prefill(tokens, lengths, slot_ids, settings))
        self._ran(("prefill", P))
        self.stats["prefills"] += 1
        now = time.perf_counter()
        for row, (h, slot) in enumerate(zip(group, slots)):
            h.first_token_at = now
            self._slots[slot] = h
            self._next_position[slot] = h.prompt_tokens
            self._append(h, int(first[row]))
            if h.done:
                self._slots[slot] = None

    def _deliver(self, tokens: jax.Array, owners: list[RequestHandle | None]) -> None:
        tokens = np.asarray(tokens)
        for slot, h in enumerate(owners):
            if h is None or h.done or self._slots[slot] is not h:
                continue
            if h.cancelled:
                self._finish(h, "cancelled")
            else:
                self._append(h, int(tokens[slot]))
            if h.done:
                self._slots[slot] = None
                with self._wake:
                    self._wake.notify()

    # ------------------------------------------------------------------------------ text

    def _append(self, h: RequestHandle, token: int) -> None:
        """One generated token: stream the text it completes, finish on eos/stop/length.

        Text that could be the start of a stop string is held back until it is known not to be one,
        and sent when the reply ends. The work per token is proportional to its own text
        (meshlm/serve/engine/text.py), whatever the length of the reply or of the stop strings."""
        req = h.request
        if token == self.eos_id and not req.ignore_eos:
            self._end(h, "stop", None)
            return
        h._ids.append(token)
        h.completion_tokens += 1
        if self._take_text(h, h._text.add(token), token):
            return
        if h.completion_tokens >= req.max_tokens or h.prompt_tokens + h.completion_tokens >= self.max_seq_len:
            self._end(h, "length", token)
            return
        send = len(h._held) - min(h._stops.partial, len(h._held))
        h._push(Event(h._held[:send], [token]))
        h._held = h._held[send:]

    def _take_text(self, h: RequestHandle, piece: str, token: int | None) -> bool:
        """Add settled text to what is held back; True (and the request finished) if a stop string ends in it."""
        start = h._stops.feed(piece)
        h._held += piece
        if start is None:
            return False
        h._held = h._held[: max(0, len(h._held) - (h._stops.fed - start))]
        self._finish(h, "stop", token=token, text=h._held)
        return True

    def _end(self, h: RequestHandle, reason: str, token: int | None) -> None:
        """The reply ends (eos or length): send what was held back and what is still unsettled."""
        if not self._take_text(h, h._text.flush(), token):
            self._finish(h, reason, token=token, text=h._held)

    def _finish(self, h: RequestHandle, reason: str, token: int | None = None, text: str = "") -> None:
        h.finish_reason = reason
        h._push(Event(text, [token] if token is not None else [], reason))
        self.stats[f"finished_{reason}"] += 1


__all__ = ["Engine", "GenerationRequest", "Event", "RequestHandle", "ScoreHandle", "QueueFull"]
