"""RingAttention: exact attention over a sequence sharded across the `sp` mesh axis.

Queries stay; keys and values (with their positions and segment ids) travel around the ring, each
step's `ppermute` issued before the block is computed so that transfers may overlap. Every step
folds the arriving shard into a running online softmax with the blockwise kernel's
`forward_chunk` (`meshlm.ops.attention`); the backward pass (a `custom_vjp`) sends k, v around
again with dk, dv accumulators. `zigzag_permutation` balances causal work over the devices.
Memory per device is O(T / sp). `ring_attention` runs on global arrays under `jit`, in a
`jax.shard_map` with the caller's specs, so batch and heads may be sharded over other axes. With
`kernel` naming a fused kernel the backend has (splash on TPU) and the token `order` known, each
step runs that kernel instead (`meshlm.ops.ring_fused`). docs/kernels.md, "RingAttention",
explains the ring, its backward, zigzag, the fused kernels per chunk and the memory.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import meshlm.ops.attention as attn
from meshlm.backends import profile_for
from meshlm.ops import ring_fused

# --------------------------------------------------------------------------------------------
# Load balancing for causal attention
# --------------------------------------------------------------------------------------------


def zigzag_permutation(seq_len: int, sp: int) -> np.ndarray:
    """Token order that balances causal attention over sp contiguous shards.

    The sequence is cut into 2*sp equal chunks; shard r receives chunks r and 2*sp-1-r, so each
    shard pairs an early (cheap) chunk with a late (expensive) one. Use as `x[:, perm]` on
    tokens, positions, segment ids and targets; undo with `inverse_permutation(perm)`.

    >>> zigzag_permutation(8, 2)
    array([0, 1, 6, 7, 2, 3, 4, 5])
    """
    if sp < 1 or seq_len % (2 * sp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 * sp = {2 * sp}")
    chunks = np.arange(seq_len).reshape(2 * sp, seq_len // (2 * sp))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * sp - 1 - r]]) for r in range(sp)])


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """The permutation that undoes `perm`: `x[:, perm][:, inverse_permutation(perm)] == x`."""
    perm = np.asarray(perm)
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inverse


# --------------------------------------------------------------------------------------------
# The per-device ring (runs inside shard_map; arrays are local shards, q grouped by kv head)
# --------------------------------------------------------------------------------------------


class _Ring(NamedTuple):
    """Static settings of the ring (hashable: a `custom_vjp` nondiff argument)."""

    axis_name: str
    axis_size: int
    causal: bool
    block_q: int
    block_kv: int
    window: int = 0
    softcap: float = 0.0
    scale: float | None = None
    overlap: bool = True  # the backend profile's `ring_overlap`

    def blocks(self) -> dict:
        """The chunk functions' static arguments."""
        return dict(causal=self.causal, block_q=self.block_q, block_kv=self.block_kv, window=self.window,
                    softcap=self.softcap, scale=self.scale)  # fmt: skip


def _send_to_next(tree, ring: _Ring):
    """Pass a pytree of local arrays one step around the ring: device r -> device r + 1."""
    if ring.axis_size == 1:
        return tree
    n = ring.axis_size
    return lax.ppermute(tree, ring.axis_name, perm=[(r, (r + 1) % n) for r in range(n)])


def _arrived(ring: _Ring, sent, held):
    """`(sent, held)`, with the transfers in `sent` finished before `held` is computed with unless the
    ring overlaps them. On XLA:CPU the transfers of a step and its data-dependent block loops, run
    concurrently, can leave the processes of a multi-process run waiting on each other for ever."""
    return (sent, held) if ring.overlap else lax.optimization_barrier((sent, held))


def _ring_forward(ring: _Ring, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Forward ring on local shards: -> (out [B,T,KVH,G,D], lse [B,KVH,G,T])."""

    def step(_, carry):
        state, kv = carry
        next_kv, kv = _arrived(ring, _send_to_next(kv, ring), kv)  # issued before the compute it may overlap
        k_i, v_i, kv_pos_i, kv_seg_i = kv
        state = attn.forward_chunk(state, q, k_i, v_i, q_pos, kv_pos_i, q_seg, kv_seg_i, **ring.blocks())
        return state, next_kv

    # The same loop body every step keeps compile time independent of sp; the price is that the
    # last step also sends its shard on (back home), a transfer nobody uses.
    init = (attn.init_state(q), (k, v, kv_pos, kv_seg))
    state, _ = lax.fori_loop(0, ring.axis_size, step, init)
    return attn.finalize_state(state, q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    return _ring_forward(ring, q, k, v, q_pos, kv_pos, q_seg, kv_seg)[0]


def _ring_attention_fwd(ring: _Ring, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = attn.name_residuals(*_ring_forward(ring, q, k, v, q_pos, kv_pos, q_seg, kv_seg))
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _ring_attention_bwd(ring: _Ring, residuals, dout):
    """Backward ring: k, v travel as in the forward pass, trailed by their dk, dv accumulators.

    Loop invariant at the start of step i on device r: `kv` is the shard from device r - i, and
    `pending` holds the accumulated (dk, dv) of the shard device r computed with at step i - 1.
    Sending `pending` on makes it arrive exactly where that shard is now (device r + 1), so each
    accumulator rides one hop behind its shard; after the loop one more hop brings it home.
    (At step 0 the pending accumulator is still zeros, and at the last step the kv shard goes
    on needlessly: two wasted transfers buy a loop body that is the same at every step.)
    """
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    delta = attn.output_delta(out, dout)

    def step(_, carry):
        dq, kv, pending = carry
        sent = (_send_to_next(kv, ring), _send_to_next(pending, ring))  # both may overlap this step's compute
        (next_kv, (dk_acc, dv_acc)), kv = _arrived(ring, sent, kv)
        k_i, v_i, kv_pos_i, kv_seg_i = kv
        dq, dk_acc, dv_acc = attn.backward_chunk(
            (dq, dk_acc, dv_acc), q, k_i, v_i, q_pos, kv_pos_i, q_seg, kv_seg_i, dout, lse, delta,
            **ring.blocks(),
        )  # fmt: skip
        return dq, next_kv, (dk_acc, dv_acc)

    # Accumulators are float32 (for bf16 inputs this doubles the dk/dv traffic, for accuracy).
    zeros = jnp.zeros_like(k, dtype=jnp.float32)
    init = (jnp.zeros_like(q, dtype=jnp.float32), (k, v, kv_pos, kv_seg), (zeros, zeros))
    dq, _, pending = lax.fori_loop(0, ring.axis_size, step, init)
    dk, dv = _send_to_next(pending, ring)  # the last hop home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


# --------------------------------------------------------------------------------------------
# Public entry point (global arrays)
# --------------------------------------------------------------------------------------------


def _axes(entry) -> tuple:
    """Mesh axes named by one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def ring_block_size(requested: int, local_len: int, causal: bool) -> int:
    """Block size used on a local shard of `local_len` tokens.

    The largest divisor of the shard (of half the shard when causal) that is at most `requested`:
    a zigzag shard (two chunks of different positions) is then split into at least two blocks so
    the masked half can be skipped, and any seq_len divisible by 2 × sp works.
    """
    span = local_len // 2 if causal and local_len % 2 == 0 else local_len
    block = min(requested, span)
    while span % block:
        block -= 1
    return block


def ring_attention(
    q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    causal=True, mesh: Mesh, axis_name: str, qkv_spec: PartitionSpec, seq_spec: PartitionSpec,
    block_q: int = 512, block_kv: int = 512, window: int = 0, softcap: float = 0.0, scale: float | None = None,
    kernel: str = "blockwise", order: str | None = None, interpret: bool = False,
):  # fmt: skip
    """Exact attention with the sequence sharded over mesh axis `axis_name` (RingAttention).

    Arguments are global arrays (call under `jit`) with the shapes and masking rule of
    `meshlm.ops.attention` (q [B,T,H,D], k/v [B,S,KVH,D], positions [B,T] / [B,S]).
    `qkv_spec` is the PartitionSpec of q, k, v and the output, e.g.
    P(('dp', 'fsdp'), 'sp', 'tp', None); `seq_spec` that of positions and segment ids, e.g.
    P(('dp', 'fsdp'), 'sp'). Their length entries must name `axis_name`; other axes may shard
    batch and heads freely. Tokens may be in any order (e.g. `zigzag_permutation`): masking
    and block skipping use only the positions. Block sizes apply to the local shard (see
    `ring_block_size`); the local lengths must be divisible by them (ValueError otherwise).
    `window`, `softcap`, `scale`: as in `meshlm.ops.attention.dot_product_attention`. A step whose
    arriving shard no local query block may attend (from the blocks' position ranges, so zigzag
    halves count apart), e.g. wholly outside the window, skips its compute; its transfer still runs.

    `kernel`: the `--attention` choice (`meshlm.ops.kernel_names.KERNELS`); `auto` or `splash` on a TPU
    mesh runs splash on every chunk (`meshlm.ops.ring_fused`), which masks by index: `order` must say
    how tokens lie ("contiguous": shard r holds the r-th 1/sp of the sequence; "zigzag":
    `zigzag_permutation`), positions must count up along each document (segment ids mark the documents)
    and chunks be multiples of 128 tokens. Any other call, or kernel, runs the blockwise kernel above.
    `interpret`: splash in Pallas interpret mode, on any backend (tests).
    """
    attn.check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    qkv_spec, seq_spec = PartitionSpec(*qkv_spec), PartitionSpec(*seq_spec)
    if axis_name not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis_name!r}; its axes are {tuple(mesh.shape)}")
    for name, spec in (("qkv_spec", qkv_spec), ("seq_spec", seq_spec)):
        if len(spec) < 2 or _axes(spec[1]) != (axis_name,):
            raise ValueError(f"{name}={spec} must shard the length (dim 1) over {axis_name!r} only")
    sp = mesh.shape[axis_name]
    t, s = q.shape[1], k.shape[1]
    if t % sp or s % sp:
        raise ValueError(f"lengths {t} / {s} are not divisible by {axis_name}={sp}")
    local_t, local_s = t // sp, s // sp
    if fused_kernel(kernel, _platform(mesh), interpret) and t == s:
        fused = ring_fused.FusedRing(axis_name, sp, str(order), bool(causal), int(window) if window < t else 0,
                                     float(softcap), bool(interpret))  # fmt: skip
        if ring_fused.why_not(order, fused.causal, fused.window, local_t) is None:
            return _sharded(functools.partial(ring_fused.fused_ring_attention, fused, scale=scale),
                            q, k, v, None, None, q_segment_ids, kv_segment_ids, mesh, qkv_spec, seq_spec)  # fmt: skip
    ring = _Ring(
        axis_name=axis_name,
        axis_size=sp,
        causal=bool(causal),
        block_q=ring_block_size(block_q, local_t, causal),
        block_kv=ring_block_size(block_kv, local_s, causal),
        window=int(window),
        softcap=float(softcap),
        scale=None if scale is None else float(scale),
        overlap=profile_for(_platform(mesh)).ring_overlap,
    )
    attn.block_sizes(local_t, local_s, ring.block_q, ring.block_kv)  # raises if they don't fit

    def per_shard(q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None):
        grouped_q = attn.group_queries(q, k.shape[2])
        out = _ring_attention(ring, grouped_q, k, v, q_pos, kv_pos, q_seg, kv_seg)
        return attn.ungroup_queries(out)

    return _sharded(per_shard, q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, mesh, qkv_spec,
                    seq_spec)  # fmt: skip


def _sharded(per_shard, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mesh, qkv_spec, seq_spec):
    """`per_shard(q, k, v, [q_pos, kv_pos,] [q_seg, kv_seg])` in a shard_map; None positions are left out."""
    args = [q, k, v] + ([] if q_pos is None else [q_pos, kv_pos]) + ([] if q_seg is None else [q_seg, kv_seg])
    specs = [qkv_spec] * 3 + [seq_spec] * (len(args) - 3)
    # Pallas calls declare no varying mesh axes for their outputs: check_vma cannot type them.
    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=tuple(specs), out_specs=qkv_spec,
                            check_vma=q_pos is not None)  # fmt: skip
    return sharded(*args)


def fused_kernel(kernel: str, platform: str, interpret: bool = False) -> str | None:
    """The fused kernel the ring runs per chunk for the `--attention` choice `kernel` on `platform`:
    "splash" for splash on TPU (or in interpret mode anywhere), else None (blockwise). `auto` keeps the
    blockwise ring, whose collectives and memory the planner models; GPU keeps blockwise too:
    docs/kernels.md, "RingAttention", says why."""
    if kernel == "splash" and (platform == "tpu" or interpret):
        return "splash"
    return None


def _platform(mesh) -> str:
    """The platform of the mesh's devices (an abstract mesh, which has none: where JAX runs)."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    return jax.devices()[0].platform
