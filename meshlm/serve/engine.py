"""The generation engine: prefill and decode with a KV cache on the mesh, continuous batching.

    engine = Engine(load_model("outputs/run", mesh), max_batch=16)
    engine.start()                                    # compiles every shape it will ever run
    handle = engine.submit(GenerationRequest(prompt_ids, max_tokens=64, sampling=SamplingParams(0.7)))
    for event in handle.iter_sync():                  # or: async for event in handle
        print(event.text, end="")

How it runs. The engine owns `max_batch` slots. Each slot is a row of the KV cache (one buffer per
layer, [B, S, K, D] laid out (batch, cache_length, kv_heads, head_dim): batch over dp×fsdp, kv heads
over tp, cache length over sp) plus its row of small per-slot arrays (next token, position, sampling
settings). A loop on its own thread repeats:

  1. admit: waiting requests take free slots. Their prompts, right-padded to the smallest length
     bucket that holds them, run through the model in one prefill (RingAttention when sp > 1),
     which writes their keys and values into their cache rows and samples each first token.
  2. decode: one jitted, donated step advances the busy slots by one token. It runs the smallest
     compiled number of rows that holds them and attends only the cache prefix their tokens fill
     (`decode_buckets`).
  3. deliver: the previous step's tokens come to the host (the next step is already queued on the
     device, so the host's work overlaps the device's), become text, and finished requests free
     their slots for step 1.

Compiled shapes: a prefill per prompt-length bucket and a decode step per (rows, cache prefix)
bucket, all compiled by `start()`, so traffic never compiles (`compiled_shapes()` lets tests check).

Several processes (`link=`, see meshlm/serve/multihost.py): process 0 runs the loop above and
publishes each step's host inputs before it runs the step; every other process builds the same
engine, compiles the same shapes and calls `follow()`, which runs the published steps in order until
process 0's `stop()`. Only process 0 takes requests and reads tokens.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshlm import sharding
from meshlm.serve.loading import LoadedModel
from meshlm.serve.sampling import SamplingParams, SlotSampling, sample

log = logging.getLogger("meshlm.serve")


# ----------------------------------------------------------------------------------- requests


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

    def __init__(self, request: GenerationRequest, request_id: int):
        self.request = request
        self.id = request_id
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
        self._sent = 0  # characters of the decoded text already sent

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


# ---------------------------------------------------------------------------------- device state


class DecodeState(NamedTuple):
    """Everything the device keeps per slot. Donated to every step: updated in place."""

    cache_k: tuple[jax.Array, ...]  # L × [B, S, K, D]
    cache_v: tuple[jax.Array, ...]
    tokens: jax.Array  # [B] int32, the token each slot feeds next
    positions: jax.Array  # [B] int32, that token's position (= its cache slot)
    counts: jax.Array  # [B] int32, tokens generated so far (the sampler's random stream index)
    sampling: SlotSampling  # [B] settings


def length_buckets(max_seq_len: int, smallest: int = 32) -> tuple[int, ...]:
    """Prompt lengths that get their own compiled prefill: powers of two, capped by the context."""
    out, n = [], smallest
    while n < max_seq_len:
        out.append(n)
        n *= 2
    return tuple(out) + (max_seq_len,)


def decode_buckets(max_batch: int, data: int, max_seq_len: int, sp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The decode step's compiled shapes: (rows, cache slots attended). A step runs only the first
    rows that hold busy slots (slots are taken lowest first) and reads only the cache prefix that
    holds their tokens, so a lone request or a short context costs what it needs, not the work of
    the whole cache. Rows: max_batch, /4, /16, ... while a multiple of dp×fsdp; slots: 128, 512, ...
    (×4) below max_seq_len, then max_seq_len; the whole length when it is split over sp."""
    rows, n = [max_batch], max_batch
    while n % 4 == 0 and (n // 4) % data == 0:
        n //= 4
        rows.append(n)
    lengths, n = [], 128
    while sp == 1 and n < max_seq_len:
        lengths.append(n)
        n *= 4
    return tuple(sorted(rows)), tuple(lengths) + (max_seq_len,)


def split_layers(params: dict, shardings: dict) -> tuple[dict, tuple[dict, ...]]:
    """(every weight but the stacked `layers`, one tree per layer): each layer's weights become their
    own buffers, so a decode step's matmuls read them in place (a slice of the stacked array is a
    copy on CPU: it tripled the weight traffic of a step). Done once, on the devices, layer by layer."""
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    one = jax.tree.map(lambda sh: jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*sh.spec[1:])),
                       shardings["layers"])
    take = jax.jit(lambda tree, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree),
                   out_shardings=one)
    layers = tuple(take(stacked, np.int32(i)) for i in range(n))
    return {k: v for k, v in params.items() if k != "layers"}, layers


def _scatter_rows(x: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    return x.at[slots].set(rows.astype(x.dtype), mode="drop")  # padding rows carry slot B: dropped


# ------------------------------------------------------------------------------------------ engine


class Engine:
    """Continuous-batching generation for one model on one mesh. Thread-safe `submit`."""

    def __init__(self, model: LoadedModel, *, max_batch: int = 8, max_seq_len: int | None = None,
                 prefill_buckets: tuple[int, ...] | None = None, prefill_batch: int | None = None, link=None):
        from meshlm.errors import UsageError

        placement = model.placement
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        self.chat_template = model.chat_template
        self.mesh = placement.mesh
        shape = dict(self.mesh.shape)
        data, sp = shape["dp"] * shape["fsdp"], shape["sp"]
        cfg = model.cfg
        self.max_seq_len = int(max_seq_len or min(cfg.max_seq_len, 2048))
        if self.max_seq_len > cfg.max_seq_len:
            raise UsageError(f"--max_seq_len={self.max_seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        if max_batch <= 0 or max_batch % data:
            raise UsageError(f"--max_batch={max_batch} must be a positive multiple of dp×fsdp = {data} "
                             f"(try --max_batch={max(data, math.ceil(max(max_batch, 1) / data) * data)})")
        self.max_batch = max_batch
        self.buckets = tuple(sorted(prefill_buckets or length_buckets(self.max_seq_len)))
        for n in (*self.buckets, self.max_seq_len):
            if n > self.max_seq_len or (sp > 1 and n % (2 * sp)):
                raise UsageError(f"length {n} (a prefill bucket or the context) must be <= --max_seq_len and "
                                 f"divisible by 2×sp = {2 * sp}")
        self.prefill_batch = prefill_batch or data
        if self.prefill_batch % data:
            raise UsageError(f"prefill batch {self.prefill_batch} must be a multiple of dp×fsdp = {data}")
        self.eos_id = getattr(self.tokenizer, "eos_id", None)

        self._params = split_layers(model.params, placement.shardings)
        model.params = None  # the engine holds the weights split by layer now: no second copy
        self._state = self._empty_state()
        # Fixed layouts in and out, so the state a step returns is exactly what the next step expects.
        state_sh = jax.tree.map(lambda a: a.sharding, self._state)
        params_sh = jax.tree.map(lambda a: a.sharding, self._params)
        rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,), in_shardings=(params_sh, state_sh, rep, rep, rep, rep),
                                out_shardings=(state_sh, rep))
        self._decode = jax.jit(self._decode_fn, static_argnums=(2, 3), donate_argnums=(1,),
                               in_shardings=(params_sh, state_sh), out_shardings=(state_sh, rep))
        self.decode_rows, self.decode_lengths = decode_buckets(max_batch, data, self.max_seq_len, sp)

        self._slots: list[RequestHandle | None] = [None] * max_batch
        self._next_position = [0] * max_batch  # of each slot's next decode step, as dispatched
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._wake = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seed_rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.stats = collections.Counter()
        self._link = link  # multihost.Leader in process 0, Follower elsewhere; None for one process

    # ------------------------------------------------------------------------ jitted functions

    def _empty_state(self) -> DecodeState:
        cfg, B, S = self.model.cfg, self.max_batch, self.max_seq_len
        cache = self.model.placement.cache_sharding()
        small = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

        def zeros():
            return jax.jit(lambda: jnp.zeros((B, S, cfg.n_kv_heads, cfg.head_dim), jnp.dtype(cfg.dtype)),
                           out_shardings=cache)()

        host = (np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32), SlotSampling.empty(B))
        tokens, positions, counts, sampling = jax.device_put(host, small)
        return DecodeState(tuple(zeros() for _ in range(cfg.n_layers)), tuple(zeros() for _ in range(cfg.n_layers)),
                           tokens, positions, counts, sampling)

    def _prefill_fn(self, params, state: DecodeState, tokens, lengths, slots, settings: SlotSampling):
        """Run padded prompts [Bp, P], write their keys/values into cache rows `slots`, sample first tokens."""
        P = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), tokens.shape)
        with self._activate(decoding=False):
            logits, k, v = self._merge(params).prefill(tokens, positions, layers=params[1], select=lengths - 1)
        first = sample(logits[:, 0], settings, jnp.zeros_like(lengths))
        cache_k = tuple(c.at[slots, :P].set(k[i].astype(c.dtype), mode="drop") for i, c in enumerate(state.cache_k))
        cache_v = tuple(c.at[slots, :P].set(v[i].astype(c.dtype), mode="drop") for i, c in enumerate(state.cache_v))
        new = DecodeState(
            cache_k, cache_v,
            _scatter_rows(state.tokens, slots, first),
            _scatter_rows(state.positions, slots, lengths),
            _scatter_rows(state.counts, slots, jnp.ones_like(lengths)),
            SlotSampling(*(_scatter_rows(a, slots, b) for a, b in zip(state.sampling, settings))),
        )
        return new, first

    def _merge(self, params):
        """The model over (other weights, per-layer weights); its blocks come from `layers=`."""
        rest, layers = params
        return nnx.merge(self.model.placement.graphdef, {**rest, "layers": layers[0]})

    def _activate(self, decoding: bool):
        strategy = self.model.placement.strategy
        return sharding.activate(self.mesh, sharding.for_decoding(strategy) if decoding else strategy)

    def _decode_fn(self, params, state: DecodeState, rows: int, length: int):
        """The first `rows` slots advance one token, attending the first `length` slots of the cache
        (the rest of the state stays as it is). The tokens [rows] are returned."""
        with self._activate(decoding=True):
            logits, cache_k, cache_v = self._merge(params).decode(
                state.tokens[:rows, None], state.positions[:rows, None], state.cache_k, state.cache_v,
                layers=params[1], length=length,
            )
        nxt = sample(logits[:, 0], SlotSampling(*(a[:rows] for a in state.sampling)), state.counts[:rows])
        last = self.max_seq_len - 1  # idle slots run on harmlessly; keep their writes inside the cache
        new = DecodeState(cache_k, cache_v, state.tokens.at[:rows].set(nxt),
                          state.positions.at[:rows].set(jnp.minimum(state.positions[:rows] + 1, last)),
                          state.counts.at[:rows].add(1), state.sampling)
        return new, nxt

    def _decode_shape(self) -> tuple[int, int]:
        """The smallest compiled (rows, length) that holds every busy slot and the positions it writes."""
        busy = [i for i, h in enumerate(self._slots) if h is not None]
        rows = next(r for r in self.decode_rows if r > busy[-1])
        reach = max(self._next_position[i] for i in busy) + 1
        return rows, next((n for n in self.decode_lengths if n >= reach), self.decode_lengths[-1])

    # --------------------------------------------------------------------------- public API

    def compiled_shapes(self) -> int:
        """How many shapes are compiled (prefill buckets + decode buckets): constant after `start()`."""
        return self._prefill._cache_size() + self._decode._cache_size()

    def check(self, request: GenerationRequest) -> None:
        """Raise ValueError if this request can never run here (before it is queued)."""
        n = len(request.prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if not isinstance(request.max_tokens, int) or request.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        if n > self.buckets[-1]:
            raise ValueError(f"the prompt has {n} tokens but the longest prompt this server takes is {self.buckets[-1]}")
        if n + request.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context of "
                             f"{self.max_seq_len} tokens; shorten the prompt or lower max_tokens to "
                             f"{max(self.max_seq_len - n, 0)}")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; its events stream from the returned handle. Thread-safe, never blocks."""
        self.check(request)
        handle = RequestHandle(request, next(self._ids))
        with self._wake:
            self._waiting.append(handle)
            self._wake.notify()
        return handle

    def generate(self, prompt: str, max_tokens: int = 16, **sampling) -> str:
        """Convenience: the text generated for `prompt`, blocking."""
        ids = self.tokenizer.encode(prompt)
        return self.submit(GenerationRequest(ids, max_tokens, SamplingParams(**sampling))).result()[0]

    def start(self, warmup: bool = True) -> "Engine":
        if warmup:
            self.warmup()
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
            jax.block_until_ready(self._state)

    def follow(self) -> None:
        """Process k > 0 of several: run the steps process 0 publishes, in order, until it stops.
        SIGINT/SIGTERM here wait for process 0's stop (multihost.signals_wait_for_leader)."""
        from meshlm.serve.multihost import signals_wait_for_leader

        with signals_wait_for_leader(self._link):
            self._follow()
        jax.block_until_ready(self._state)

    def _follow(self) -> None:
        while True:
            step = self._link.receive()
            if step.kind == "stop":
                break
            if step.kind == "prefill":
                self._state, _ = self._prefill(self._params, self._state, *step.args)
                self.stats["prefills"] += 1
            else:
                self._state, _ = self._decode(self._params, self._state, *step.args)
                self.stats["decode_steps"] += 1

    def warmup(self) -> float:
        """Compile the decode step and every prefill bucket (padding rows only: nothing changes)."""
        t0 = time.perf_counter()
        Bp = self.prefill_batch
        none = np.full(Bp, self.max_batch, np.int32)  # every row is padding
        for P in self.buckets:
            self._state, first = self._prefill(self._params, self._state, np.zeros((Bp, P), np.int32),
                                               np.ones(Bp, np.int32), none, SlotSampling.empty(Bp))
        for rows in self.decode_rows:
            for length in self.decode_lengths:
                self._state, nxt = self._decode(self._params, self._state, rows, length)
        jax.block_until_ready((first, nxt))
        seconds = time.perf_counter() - t0
        log.info("compiled %d prefill buckets %s and decode steps for %s rows × %s cache slots in %.1f s",
                 len(self.buckets), self.buckets, self.decode_rows, self.decode_lengths, seconds)
        return seconds

    @classmethod
    def for_testing(cls, preset: str = "test", mesh_dim: str = "1,1,1,1", max_batch: int = 8,
                    max_seq_len: int = 256, seed: int = 0, start: bool = True, **kw) -> "Engine":
        """Random weights of a preset with a small byte-level tokenizer, on the first devices."""
        from meshlm import mesh as meshlib
        from meshlm.data.tokenizer import train_tokenizer
        from meshlm.models.configs import resolve_model
        from meshlm.serve.loading import random_model

        cfg = resolve_model(preset).replace(dtype="float32", param_dtype="float32")
        n = math.prod(int(x) for x in mesh_dim.split(","))
        shape = meshlib.parse_mesh_dim(mesh_dim, n)
        mesh = meshlib.build_mesh(shape, jax.devices()[:n])
        tokenizer = train_tokenizer("stdlib", cfg.vocab_size, train_chars=400_000)
        engine = cls(random_model(cfg, mesh, tokenizer, seed=seed, name=preset), max_batch=max_batch,
                     max_seq_len=max_seq_len, **kw)
        return engine.start() if start else engine

    # ---------------------------------------------------------------------------- the loop

    def _run(self) -> None:
        pending = None  # (tokens on device, owner of each slot when that step was dispatched)
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and pending is None and not any(self._slots):
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self._admit()
                if any(h is not None for h in self._slots):
                    shape = self._decode_shape()
                    if self._link is not None:
                        self._link.decode(*shape)
                    self._state, tokens = self._decode(self._params, self._state, *shape)
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
        for h in [*self._slots, *self._waiting]:
            if h is not None and not h.done:
                self._finish(h, "cancelled")

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, a group of up to `prefill_batch` at a time."""
        while True:
            with self._wake:
                while self._waiting and self._waiting[0].cancelled:
                    self._finish(self._waiting.popleft(), "cancelled")
                free = [i for i, h in enumerate(self._slots) if h is None]
                take = min(len(free), len(self._waiting), self.prefill_batch)
                group = [self._waiting.popleft() for _ in range(take)]
            if not group:
                return
            self._prefill_group(group, free[:len(group)])

    def _prefill_group(self, group: list[RequestHandle], slots: list[int]) -> None:
        Bp = self.prefill_batch
        longest = max(h.prompt_tokens for h in group)
        P = next(b for b in self.buckets if b >= longest)
        tokens = np.zeros((Bp, P), np.int32)
        lengths = np.ones(Bp, np.int32)
        slot_ids = np.full(Bp, self.max_batch, np.int32)
        for row, (h, slot) in enumerate(zip(group, slots)):
            tokens[row, :h.prompt_tokens] = h.request.prompt_ids
            lengths[row], slot_ids[row] = h.prompt_tokens, slot
        params = [h.request.sampling for h in group] + [SamplingParams(temperature=0.0)] * (Bp - len(group))
        settings = SlotSampling.host(params, [self._seed_rng.getrandbits(32) for _ in params])
        if self._link is not None:
            self._link.prefill(tokens, lengths, slot_ids, settings)
        self._state, first = self._prefill(self._params, self._state, tokens, lengths, slot_ids, settings)
        self.stats["prefills"] += 1
        first = np.asarray(first)
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
        """One generated token: stream the text it completes, finish on eos/stop/length."""
        req = h.request
        if token == self.eos_id and not req.ignore_eos:
            self._finish(h, "stop")
            return
        h._ids.append(token)
        h.completion_tokens += 1
        text = self.tokenizer.decode(h._ids)
        for stop in req.stop:
            at = text.find(stop, max(0, h._sent - len(stop)))
            if at >= 0:
                self._finish(h, "stop", token=token, text=text[h._sent:at])
                return
        if h.completion_tokens >= req.max_tokens or h.prompt_tokens + h.completion_tokens >= self.max_seq_len:
            self._finish(h, "length", token=token, text=text[h._sent:])
            return
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)  # an incomplete UTF-8 character
        end -= max((k for stop in req.stop for k in range(1, len(stop)) if text[:end].endswith(stop[:k])), default=0)
        h._push(Event(text[h._sent:end] if end > h._sent else "", [token]))
        h._sent = max(h._sent, end)

    def _finish(self, h: RequestHandle, reason: str, token: int | None = None, text: str = "") -> None:
        h.finish_reason = reason
        h._push(Event(text, [token] if token is not None else [], reason))
        self.stats[f"finished_{reason}"] += 1


__all__ = ["Engine", "GenerationRequest", "Event", "RequestHandle", "DecodeState", "length_buckets", "decode_buckets"]
