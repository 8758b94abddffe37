"""RingAttention with the backend's fused kernel on each arriving chunk (splash on TPU).

The kernels mask by index, so each ring step is planned statically (`_plan`): which local rows
attend which arriving keys, at what index offset (contiguous order: causal on the first step, then
whole chunks, a sliding window as splash's `LocalMask` at the step's offset; zigzag: the late half
attends the arriving early half, plus one call on halves selected by whether the ring wrapped). The
ring is unrolled and every per-device choice is a select on data, never a `lax.cond`. The forward
merges each call's (out, lse); the backward (a `custom_vjp`) runs the kernel's backward per call with
the *global* output and log-sum-exp, the chunk's exact share of dq, dk, dv, while dk, dv trail their
shard one hop behind. `meshlm.ops.ring.ring_attention(kernel=..., order=...)` dispatches here;
docs/kernels.md, "RingAttention", has the whole story and what stays on the blockwise ring.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshlm.ops import splash
from meshlm.ops.attention import name_residuals, score_scale

ORDERS = ("contiguous", "zigzag")


class FusedRing(NamedTuple):
    """Static settings of the fused ring (hashable: a `custom_vjp` nondiff argument)."""

    axis_name: str
    axis_size: int
    order: str  # "contiguous" or "zigzag": how the local tokens lie in the sequence
    causal: bool
    window: int = 0
    softcap: float = 0.0
    interpret: bool = False

    def cfg(self) -> dict:
        return dict(causal=self.causal, window=self.window, softcap=self.softcap, interpret=self.interpret)


class _Call(NamedTuple):
    """One kernel call of a ring step. Parts: "all" rows, the "first" or "second" half, or "pick": the
    first half where this device's step has not wrapped (rank >= step), else the second. `offset`:
    how far the keys lie behind the queries, in index (None: every pair in reach). `gated`: the call
    counts only where the step has not wrapped."""

    q_part: str
    kv_part: str
    offset: int | None
    gated: bool = False


def why_not(order: str | None, causal: bool, window: int, local_len: int) -> str | None:
    """Why the fused ring cannot serve a call (None: it can). `local_len`: tokens per device."""
    if not causal and window:
        return "a window without causal masking"
    if causal and order not in ORDERS:
        return "the token order is not known (contiguous or zigzag)"
    if order == "zigzag" and window:
        return "zigzag order with a window (the late half's distance to an early half differs per device)"
    chunk = local_len // 2 if causal and order == "zigzag" else local_len
    if chunk % 128 or chunk * 2 < local_len:
        return f"chunks of {chunk} tokens (the kernel's blocks are multiples of 128)"
    return None


def _plan(ring: FusedRing, local_len: int) -> list[list[_Call]]:
    """The kernel calls of each ring step, ending at the last step that has any."""
    if not ring.causal:
        return [[_Call("all", "all", None)]] * ring.axis_size
    if ring.order == "zigzag":
        later = [_Call("second", "first", None), _Call("pick", "pick", None)]
        return [[_Call("all", "all", 0)]] + [later] * (ring.axis_size - 1)
    steps = [[_Call("all", "all", 0)]]
    for i in range(1, ring.axis_size):
        offset = i * local_len  # the nearest key lies offset - (local_len - 1) behind
        if ring.window and offset - (local_len - 1) >= ring.window:
            break
        steps.append([_Call("all", "all", None if not ring.window else offset, gated=True)])
    return steps


def _send(tree, ring: FusedRing, shift: int = 1):
    """Pass a pytree `shift` devices on around the ring (negative: back)."""
    n = ring.axis_size
    if shift % n == 0:
        return tree
    return lax.ppermute(tree, ring.axis_name, perm=[(r, (r + shift) % n) for r in range(n)])


def _part(x, part: str, early, axis: int):
    """Rows of x along `axis` (`_Call` parts); None stays None."""
    if x is None or part == "all":
        return x
    first, second = jnp.split(x, 2, axis=axis)
    if part == "pick":
        return jnp.where(early, first, second)
    return first if part == "first" else second


def _place(x, part: str, early, axis: int, empty):
    """x on `part`'s rows of a full-length array whose other rows hold `empty` (the inverse of `_part`)."""
    if part == "all":
        return x
    blank = jnp.full_like(x, empty)
    if part == "pick":
        halves = (jnp.where(early, x, blank), jnp.where(early, blank, x))
    else:
        halves = (x, blank) if part == "first" else (blank, x)
    return jnp.concatenate(halves, axis=axis)


def _merge(out, lse, out_c, lse_c):
    """Fold a call's (out [B,T,H,D] float32, lse [B,H,T]) into the running pair (lse -inf: nothing)."""
    new = jnp.logaddexp(lse, lse_c)
    safe = jnp.where(new == -jnp.inf, 0.0, new)
    weight = lambda l: jnp.swapaxes(jnp.exp(l - safe), 1, 2)[..., None]  # noqa: E731
    return out * weight(lse) + out_c * weight(lse_c), new


def _forward(ring: FusedRing, q, k, v, q_seg, kv_seg):
    """(out [B,T,H,D] in q's dtype, lse [B,H,T] float32) of pre-scaled q over the whole ring."""
    steps = _plan(ring, q.shape[1])
    out = jnp.zeros_like(q, dtype=jnp.float32)
    lse = jnp.full(out.shape[:1] + out.shape[2:3] + out.shape[1:2], -jnp.inf, jnp.float32)
    kv = (k, v, kv_seg)
    for i, calls in enumerate(steps):
        early = lax.axis_index(ring.axis_name) >= i
        incoming = _send(kv, ring) if i + 1 < len(steps) else None  # issued before the compute
        k_i, v_i, kv_seg_i = kv
        for c in calls:
            out_c, lse_c = splash.splash_chunk_forward(
                _part(q, c.q_part, early, 1), _part(k_i, c.kv_part, early, 1), _part(v_i, c.kv_part, early, 1),
                _part(q_seg, c.q_part, early, 1), _part(kv_seg_i, c.kv_part, early, 1),
                offset=c.offset, cfg=ring.cfg(),
            )  # fmt: skip
            if c.gated:
                lse_c = jnp.where(early, lse_c, -jnp.inf)
            out_c = _place(out_c.astype(jnp.float32), c.q_part, early, 1, 0.0)
            out, lse = _merge(out, lse, out_c, _place(lse_c, c.q_part, early, 2, -jnp.inf))
        kv = incoming
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_ring(ring: FusedRing, q, k, v, q_seg, kv_seg):
    return _forward(ring, q, k, v, q_seg, kv_seg)[0]


def _fused_ring_fwd(ring: FusedRing, q, k, v, q_seg, kv_seg):
    out, lse = name_residuals(*_forward(ring, q, k, v, q_seg, kv_seg))
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _fused_ring_bwd(ring: FusedRing, residuals, dout):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    steps = _plan(ring, q.shape[1])
    dq = jnp.zeros_like(q, dtype=jnp.float32)
    zeros = jnp.zeros_like(k, dtype=jnp.float32)
    kv, pending = (k, v, kv_seg), (zeros, zeros)
    for i, calls in enumerate(steps):
        early = lax.axis_index(ring.axis_name) >= i
        incoming = _send(kv, ring) if i + 1 < len(steps) else None
        # The accumulators of the shard this device now holds, from the device that held it last step.
        dk_acc, dv_acc = _send(pending, ring) if i else pending
        k_i, v_i, kv_seg_i = kv
        for c in calls:
            rows, keys = (
                functools.partial(_part, part=c.q_part, early=early),
                functools.partial(_part, part=c.kv_part, early=early),
            )
            dq_c, dk_c, dv_c = splash.splash_chunk_backward(
                rows(q, axis=1), keys(k_i, axis=1), keys(v_i, axis=1), rows(q_seg, axis=1), keys(kv_seg_i, axis=1),
                rows(out, axis=1), rows(lse, axis=2), rows(dout, axis=1), offset=c.offset, cfg=ring.cfg(),
            )  # fmt: skip
            if c.gated:
                dq_c, dk_c, dv_c = (jnp.where(early, g, 0.0) for g in (dq_c, dk_c, dv_c))
            dq = dq + _place(dq_c, c.q_part, early, 1, 0.0)
            dk_acc = dk_acc + _place(dk_c, c.kv_part, early, 1, 0.0)
            dv_acc = dv_acc + _place(dv_c, c.kv_part, early, 1, 0.0)
        kv, pending = incoming, (dk_acc, dv_acc)
    # The shard held at the last step came from len(steps) - 1 devices back: send its gradients home.
    dk, dv = _send(pending, ring, shift=1 - len(steps))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_fused_ring.defvjp(_fused_ring_fwd, _fused_ring_bwd)


def fused_ring_attention(ring: FusedRing, q, k, v, q_seg=None, kv_seg=None, *, scale: float | None = None):
    """Local shards (inside `shard_map`): q [B,T,H,D], k, v [B,T,KVH,D], segment ids [B,T] or None ->
    [B,T,H,D]. The kernel does not scale the scores: q is multiplied by the scale first."""
    q_scaled = q * jnp.asarray(score_scale(scale, q.shape[-1]), q.dtype)
    return _fused_ring(ring, q_scaled, k, v, q_seg, kv_seg)
