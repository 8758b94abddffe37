"""Serving across processes: process 0 decides every engine step, the others repeat it.

Every process of a multi-controller JAX program must run the same jitted computations in the same
order. Process 0 runs the HTTP server and the engine's loop and, before each step, publishes the
step's host inputs through the coordinator's key-value store (step n is the key
`meshlm/serve/step/B/n`, B = n // BLOCK); the other processes read the steps in order and run each
on the same compiled function. How the store is kept small: docs/serve.md, "Inside the server".
A single process has no link: the engine calls its compiled steps directly.
"""

from __future__ import annotations

import contextlib
import io
import signal
import struct
import sys
import threading
import time
from typing import NamedTuple

import numpy as np

from meshlm.serve.engine.sampling import SlotSampling

STEP_PREFIX = "meshlm/serve/step/"
ACK_PREFIX = "meshlm/serve/ack/"
SHARED_PREFIX = "meshlm/serve/shared/"
BLOCK = 256
_WAIT_MS = 1000  # one wait on the store; an idle follower waits again (the watchdog watches the peers)
STOP_GRACE_S = 30.0  # how long a signalled follower waits for process 0 to stop it

_PREFILL, _DECODE, _STOP = b"P", b"D", b"S"
_PREFILL_ARRAYS = ("tokens", "lengths", "slots", *SlotSampling._fields)


class Step(NamedTuple):
    """One engine step: kind "prefill" (args: tokens, lengths, slots, SlotSampling), "decode" (args:
    rows, length) or "stop" (no args)."""

    kind: str
    args: tuple = ()


def encode_prefill(tokens, lengths, slots, settings: SlotSampling) -> bytes:
    buf = io.BytesIO()
    arrays = (tokens, lengths, slots, *settings)
    np.savez(buf, **{name: np.asarray(a) for name, a in zip(_PREFILL_ARRAYS, arrays)})
    return _PREFILL + buf.getvalue()


def encode_decode(rows: int, length: int) -> bytes:
    return _DECODE + struct.pack("<ii", rows, length)


def decode_step(message: bytes) -> Step:
    kind, body = message[:1], message[1:]
    if kind == _DECODE:
        return Step("decode", struct.unpack("<ii", body))
    if kind == _PREFILL:
        with np.load(io.BytesIO(body), allow_pickle=False) as z:
            tokens, lengths, slots, *settings = (z[name] for name in _PREFILL_ARRAYS)
        return Step("prefill", (tokens, lengths, slots, SlotSampling(*settings)))
    if kind == _STOP:
        return Step("stop")
    raise ValueError(f"unknown engine step {message[:16]!r}")


def _client():
    from meshlm.distributed import _client as client

    return client()


def _is_timeout(error: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(error)


def _step_key(n: int) -> str:
    return f"{STEP_PREFIX}{n // BLOCK}/{n}"


class Leader:
    """Process 0's end: publishes each step before running it."""

    def __init__(self, num_processes: int, client=None):
        self.n = num_processes
        self._client = client or _client()
        self._next = 0
        self._kept_from = 0  # the oldest block still in the store
        self.stopped = False

    def publish(self, message: bytes) -> None:
        n = self._next
        self._client.key_value_set_bytes(_step_key(n), message)
        self._next = n + 1
        if n % BLOCK == BLOCK - 1:
            self._forget_read_blocks()

    def prefill(self, tokens, lengths, slots, settings: SlotSampling) -> None:
        self.publish(encode_prefill(tokens, lengths, slots, settings))

    def decode(self, rows: int, length: int) -> None:
        self.publish(encode_decode(rows, length))

    def stop(self) -> None:
        """The last step: the followers return from `Engine.follow`. Idempotent."""
        if not self.stopped:
            self.stopped = True
            self.publish(_STOP)

    def _forget_read_blocks(self) -> None:
        acks = dict(self._client.key_value_dir_get(ACK_PREFIX))
        read = min(int(acks.get(f"{ACK_PREFIX}{k}", 0)) for k in range(1, self.n))
        while (self._kept_from + 1) * BLOCK <= read:
            self._client.key_value_delete(f"{STEP_PREFIX}{self._kept_from}")
            self._kept_from += 1


class Follower:
    """Process k > 0's end: the steps in the order process 0 published them."""

    stopped = True  # only process 0 stops the others

    def __init__(self, process_id: int, client=None, wait_ms: int = _WAIT_MS):
        self.pid = process_id
        self._client = client or _client()
        self._next = 0
        self._wait_ms = wait_ms
        self.deadline: float | None = None  # set by a signal: stop waiting for process 0 then

    def receive(self) -> Step:
        """The next step, waiting as long as it takes (process 0 may be idle for hours)."""
        n = self._next
        while True:
            try:
                message = self._client.blocking_key_value_get_bytes(_step_key(n), self._wait_ms)
                break
            except Exception as e:  # noqa: BLE001  (the runtime's error type; only a timeout is retried)
                if not _is_timeout(e):
                    raise
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise TimeoutError(
                    f"asked to stop, but process 0 did not stop within {STOP_GRACE_S:g} s; "
                    "stop process 0 (it stops the others)"
                )
        self._next = n + 1
        if n % BLOCK == BLOCK - 1:  # every step of this block is read: process 0 may delete it
            self._client.key_value_set(f"{ACK_PREFIX}{self.pid}", str(n + 1), allow_overwrite=True)
        return decode_step(message)


@contextlib.contextmanager
def signals_wait_for_leader(follower: Follower | None, grace_s: float = STOP_GRACE_S):
    """SIGINT/SIGTERM in a follower: keep following until process 0's stop (a Ctrl-C or a cluster's
    SIGTERM reaches every process, and process 0 ends its replies first), for `grace_s` at most."""
    if follower is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, _frame):
        if follower.deadline is None:
            follower.deadline = time.monotonic() + grace_s
            print(
                f"process {follower.pid}: {signal.Signals(signum).name}: waiting up to {grace_s:g} s for "
                "process 0 to stop",
                file=sys.stderr,
                flush=True,
            )

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def link():
    """Leader in process 0 and Follower elsewhere when several processes run; None for one process."""
    import jax

    if jax.process_count() == 1:
        return None
    return Leader(jax.process_count()) if jax.process_index() == 0 else Follower(jax.process_index())


def share(name: str, value: str | None, timeout_s: float) -> str:
    """Process 0's `value` in every process (e.g. a prompt read from its standard input); one process: `value`."""
    import jax

    if jax.process_count() == 1:
        return value
    client, key = _client(), f"{SHARED_PREFIX}{name}"
    if jax.process_index() == 0:
        client.key_value_set_bytes(key, value.encode("utf-8"))
        return value
    return bytes(client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))).decode("utf-8")


__all__ = [
    "Leader",
    "Follower",
    "Step",
    "link",
    "share",
    "signals_wait_for_leader",
    "encode_prefill",
    "encode_decode",
    "decode_step",
]
