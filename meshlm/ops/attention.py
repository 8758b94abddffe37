"""Dot-product attention: the plain reference and a blockwise (flash-style) kernel.

    q [B, T, H, D], k and v [B, S, KVH, D] (H % KVH == 0), q_positions [B, T], kv_positions [B, S]
    (< 0: an empty slot), optional segment ids [B, T] / [B, S]; output [B, T, H, D] in q's dtype

A query attends a key when the key slot holds a token, (if causal) the key is not ahead, (with a
sliding window W) the key is less than W positions behind, and (if given) both are in the same
document (`meshlm.ops.attention_masks`). Scores are scaled (1/sqrt(D) unless given) and optionally
soft-capped. Masks come from positions, never indices, so one code path serves training, ring
reordering, decoding with a KV cache and packed sequences. Softmax runs in float32; grouped-query
attention never copies k/v to H heads. `forward_chunk` and `backward_chunk` fold one chunk of keys
into a running online softmax or into gradient accumulators; `meshlm.ops.ring` calls them once per
ring step. docs/kernels.md, "Dot-product and blockwise attention", has the shapes and layouts.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from meshlm.ops.attention_masks import attention_mask, block_table, check_inputs, key_block_lists

Array = jax.Array

_F32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Grouped queries: q [B,T,H,D] viewed as [B,T,KVH,G,D]
# --------------------------------------------------------------------------------------------


def group_queries(q, kv_heads: int):
    """[B,T,H,D] -> [B,T,KVH,G,D]: the G = H // KVH query heads that share one kv head."""
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d)


def ungroup_queries(x):
    """[B,T,KVH,G,D] -> [B,T,H,D]."""
    b, t, kvh, g, d = x.shape
    return x.reshape(b, t, kvh * g, d)


def _heads_major(x):
    """[B,t,KVH,G,...] -> [B,KVH,G,t,...] (undone by `_tokens_major`).

    Used on one query block at a time (hoisted out of the inner loop over key blocks), so the
    block products inside are plain matmuls batched over (B, KVH) without copying whole arrays.
    """
    return jnp.moveaxis(x, 1, 3)


def _tokens_major(x):
    return jnp.moveaxis(x, 3, 1)


def _if(needed, fn, carry, skip: bool = True):
    """`fn(carry)` if `needed` (a traced bool) else `carry` unchanged: how masked work is skipped.
    With `skip` False, `fn(carry)` always (masked work adds zeros), with no `lax.cond` around it."""
    return lax.cond(needed, fn, lambda c: c, carry) if skip else fn(carry)


def _dot(subscripts, a, b):
    """einsum with float32 accumulation."""
    return jnp.einsum(subscripts, a, b, preferred_element_type=_F32)


def score_scale(scale: float | None, head_dim: int) -> float:
    """The factor scores are multiplied by: `scale`, or 1/sqrt(head_dim) where it is None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def soft_cap(scores, softcap: float):
    """softcap * tanh(scores / softcap) (Gemma 2's logit soft-capping); scores unchanged for 0."""
    return softcap * jnp.tanh(scores / softcap) if softcap else scores


def _scores(q_blk, k_blk, scale: float | None = None, softcap: float = 0.0):
    """[B,KVH,G,tq,D] x [B,tk,KVH,D] -> float32 scores [B,KVH,G,tq,tk]: scaled (`score_scale`), then
    soft-capped."""
    raw = _dot("bhgqd,bkhd->bhgqk", q_blk, k_blk) * score_scale(scale, q_blk.shape[-1])
    return soft_cap(raw, softcap)


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _update(x, blk, start, axis):
    return lax.dynamic_update_slice_in_dim(x, blk, start, axis=axis)


def _slice_opt(x, start, size, axis):
    return None if x is None else _slice(x, start, size, axis)


def block_sizes(t: int, s: int, block_q: int, block_kv: int) -> tuple[int, int]:
    """Clamp the block sizes to the lengths; raise ValueError if they do not divide them."""
    bq, bk = min(block_q, t), min(block_kv, s)
    if bq <= 0 or bk <= 0 or t % bq or s % bk:
        raise ValueError(
            f"query length {t} / key length {s} must be divisible by the block sizes "
            f"{bq} / {bk} (block_q={block_q}, block_kv={block_kv})"
        )
    return bq, bk


# --------------------------------------------------------------------------------------------
# Forward: fold a chunk of keys/values into the online-softmax state
# --------------------------------------------------------------------------------------------


class SoftmaxState(NamedTuple):
    """Running online-softmax state of every query (float32).

    acc [B,T,KVH,G,D]: sum_k exp(s_k - m) v_k;  m [B,KVH,G,T]: running row max of the scores
    (-inf while nothing was attended);  l [B,KVH,G,T]: sum_k exp(s_k - m).
    """

    acc: Array
    m: Array
    l: Array


def init_state(q) -> SoftmaxState:
    """Empty state for grouped queries q [B,T,KVH,G,D].

    Built with `zeros_like(q)` so that, inside `shard_map`, the state varies over the same mesh
    axes as q (loop carries must keep their type).
    """
    acc = jnp.zeros_like(q, dtype=_F32)
    m = jnp.full_like(jnp.moveaxis(acc[..., 0], 1, 3), -jnp.inf)  # [B,KVH,G,T]
    return SoftmaxState(acc, m, jnp.zeros_like(m))


def finalize_state(state: SoftmaxState, dtype):
    """-> (out [B,T,KVH,G,D] in dtype, lse [B,KVH,G,T] float32; -inf where nothing attended)."""
    seen = state.l > 0
    l = jnp.where(seen, state.l, 1.0)
    out = state.acc / jnp.moveaxis(l, 3, 1)[..., None]
    lse = jnp.where(seen, state.m + jnp.log(l), -jnp.inf)
    return out.astype(dtype), lse


def _online_softmax_step(state: SoftmaxState, s, v_blk) -> SoftmaxState:
    """Fold masked scores s [B,KVH,G,tq,tk] (-inf = masked) and values v_blk [B,tk,KVH,D]
    into the state of one query block (acc heads-major here: [B,KVH,G,tq,D])."""
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))
    # A row that has seen only masked keys keeps m = -inf; shift it by 0 instead (exp(-inf) = 0).
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    rescale = jnp.exp(state.m - m_safe)  # how much the old running sums shrink
    l = state.l * rescale + jnp.sum(p, axis=-1)
    pv = _dot("bhgqk,bkhd->bhgqd", p.astype(v_blk.dtype), v_blk)
    acc = state.acc * rescale[..., None] + pv
    return SoftmaxState(acc, m_new, l)


def _visits(q_pos, kv_pos, q_seg, kv_seg, causal, window, bq, bk, skip_masked: bool):
    """(order, count, any) of `key_block_lists`; (None, None, True) for every block, no table."""
    if not skip_masked:
        return None, None, True
    table = block_table(q_pos, kv_pos, q_seg, kv_seg, causal, window, bq, bk)
    return (*key_block_lists(table), jnp.any(table))


def forward_chunk(
    state: SoftmaxState,
    q, k, v, q_pos, kv_pos, q_seg, kv_seg,
    *, causal: bool, block_q: int, block_kv: int, skip_masked: bool = True,
    window: int = 0, softcap: float = 0.0, scale: float | None = None,
) -> SoftmaxState:  # fmt: skip
    """Attend all queries to one chunk of keys/values, updating the online-softmax state.

    q [B,T,KVH,G,D], k/v [B,S,KVH,D], positions/segments [B,T] / [B,S]. Loops
    over query blocks and, inside, over the key blocks `block_table` says may be attended (a
    data-dependent trip count: blocks outside a window or above the causal diagonal are never
    visited); a query block with nothing to attend, and a chunk with nothing at all, is skipped
    by `lax.cond` (decided from position ranges, so the order of tokens does not matter). Peak
    extra memory is one [B,KVH,G,block_q,block_kv] score block. `skip_masked=False` computes every
    pair instead, with no `lax.cond`: for a single block of a causal self-attention, which always
    attends and where a conditional only costs. `window`, `softcap`, `scale`: see `attention_mask`,
    `soft_cap` and `score_scale`.
    """
    t, s = q.shape[1], k.shape[1]
    bq, bk = block_sizes(t, s, block_q, block_kv)
    order, count, some = _visits(q_pos, kv_pos, q_seg, kv_seg, causal, window, bq, bk, skip_masked)

    def per_query_block(i, state):
        q0 = i * bq
        qp, qs = _slice(q_pos, q0, bq, 1), _slice_opt(q_seg, q0, bq, 1)

        def attend_row(state):
            q_blk = _heads_major(_slice(q, q0, bq, 1))
            blk_state = SoftmaxState(
                _heads_major(_slice(state.acc, q0, bq, 1)),
                _slice(state.m, q0, bq, 3),
                _slice(state.l, q0, bq, 3),
            )

            def per_key_block(n, blk_state):
                k0 = (n if order is None else order[i, n]) * bk
                kp, ks = _slice(kv_pos, k0, bk, 1), _slice_opt(kv_seg, k0, bk, 1)
                scores = _scores(q_blk, _slice(k, k0, bk, 1), scale, softcap)
                mask = attention_mask(qp, kp, qs, ks, causal, window)[:, None, None]
                scores = jnp.where(mask, scores, -jnp.inf)
                return _online_softmax_step(blk_state, scores, _slice(v, k0, bk, 1))

            blk_state = lax.fori_loop(0, s // bk if count is None else count[i], per_key_block, blk_state)
            return SoftmaxState(
                _update(state.acc, _tokens_major(blk_state.acc), q0, 1),
                _update(state.m, blk_state.m, q0, 3),
                _update(state.l, blk_state.l, q0, 3),
            )

        # A query block with nothing to attend in this chunk skips even its setup.
        return _if(count is None or count[i] > 0, attend_row, state, skip_masked)

    return _if(some, lambda state: lax.fori_loop(0, t // bq, per_query_block, state), state, skip_masked)


# --------------------------------------------------------------------------------------------
# Backward: gradients from one chunk of keys/values, scores recomputed blockwise
# --------------------------------------------------------------------------------------------


def backward_chunk(
    grads,
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, dout, lse, delta,
    *, causal: bool, block_q: int, block_kv: int, skip_masked: bool = True,
    window: int = 0, softcap: float = 0.0, scale: float | None = None,
):  # fmt: skip
    """Gradients of the attention of all queries to one chunk of keys/values.

    Layouts as in `forward_chunk`; dout [B,T,KVH,G,D] is the output cotangent,
    lse [B,KVH,G,T] the log-sum-exp of each query's scores over *all* keys (from the forward
    pass) and delta = sum(dout * out, -1). With p = exp(s - lse) the exact softmax
    probabilities are recovered block by block, so nothing of size T x S is ever stored:

        dv += p^T dout      dp = dout v^T      ds = p * (dp - delta) * c * scale
        dq += ds k          dk += ds^T q

    where c = 1 - tanh^2(raw / softcap) is the soft cap's derivative (1 without one).
    grads = (dq [B,T,KVH,G,D], dk [B,S,KVH,D], dv [B,S,KVH,D]), float32 accumulators that this
    chunk's contributions are added to (in place, so no extra copies); returns the updated
    triple. Only the key blocks `block_table` allows are visited (as in `forward_chunk`).
    """
    t, s = q.shape[1], k.shape[1]
    bq, bk = block_sizes(t, s, block_q, block_kv)
    factor = score_scale(scale, q.shape[-1])
    order, count, some = _visits(q_pos, kv_pos, q_seg, kv_seg, causal, window, bq, bk, skip_masked)

    def per_query_block(i, grads):
        q0 = i * bq
        qp, qs = _slice(q_pos, q0, bq, 1), _slice_opt(q_seg, q0, bq, 1)

        def attend_row(grads):
            dq, dk, dv = grads
            q_blk = _heads_major(_slice(q, q0, bq, 1))
            do_blk = _heads_major(_slice(dout, q0, bq, 1))
            lse_blk, delta_blk = _slice(lse, q0, bq, 3), _slice(delta, q0, bq, 3)

            def per_key_block(n, carry):
                dq_blk, dk, dv = carry
                k0 = (n if order is None else order[i, n]) * bk
                kp, ks = _slice(kv_pos, k0, bk, 1), _slice_opt(kv_seg, k0, bk, 1)
                k_blk, v_blk = _slice(k, k0, bk, 1), _slice(v, k0, bk, 1)
                mask = attention_mask(qp, kp, qs, ks, causal, window)[:, None, None]
                scores = _scores(q_blk, k_blk, factor, softcap)
                # Masked entries (and rows with lse = -inf: fully masked) give p = 0.
                p = jnp.where(mask, jnp.exp(scores - lse_blk[..., None]), 0.0)
                dv_blk = _dot("bhgqk,bhgqd->bkhd", p.astype(do_blk.dtype), do_blk)
                dp = _dot("bhgqd,bkhd->bhgqk", do_blk, v_blk)
                ds = p * (dp - delta_blk[..., None]) * factor
                if softcap:
                    ds = ds * (1.0 - jnp.square(scores / softcap))
                ds = ds.astype(q.dtype)
                dq_blk += _dot("bhgqk,bkhd->bhgqd", ds, k_blk)
                dk_blk = _dot("bhgqk,bhgqd->bkhd", ds, q_blk)
                dk = _update(dk, _slice(dk, k0, bk, 1) + dk_blk, k0, 1)
                dv = _update(dv, _slice(dv, k0, bk, 1) + dv_blk, k0, 1)
                return dq_blk, dk, dv

            carry = (_heads_major(_slice(dq, q0, bq, 1)), dk, dv)
            dq_blk, dk, dv = lax.fori_loop(0, s // bk if count is None else count[i], per_key_block, carry)
            return _update(dq, _tokens_major(dq_blk), q0, 1), dk, dv

        # A query block with nothing to attend in this chunk skips even its setup.
        return _if(count is None or count[i] > 0, attend_row, grads, skip_masked)

    run = lambda grads: lax.fori_loop(0, t // bq, per_query_block, tuple(grads))  # noqa: E731
    return _if(some, run, tuple(grads), skip_masked)


# Every attention kernel tags its output OUT_NAME and the log-sum-exp its backward reads LSE_NAME
# (`checkpoint_name`; custom-VJP kernels tag the residuals of their forward rule): a remat policy
# (`meshlm.models.decoder.REMAT_POLICIES`) that saves both never runs the kernel's forward again.
OUT_NAME, LSE_NAME = "attn_out", "attn_lse"


def name_residuals(out, lse):
    """(out, lse) tagged OUT_NAME and LSE_NAME for the remat policies; the values are unchanged."""
    return checkpoint_name(out, OUT_NAME), checkpoint_name(lse, LSE_NAME)


def output_delta(out, dout):
    """delta = rowsum(dout * out) in float32 [B,KVH,G,T], the softmax term of the backward."""
    return jnp.moveaxis(jnp.sum(out.astype(_F32) * dout.astype(_F32), axis=-1), 1, 3)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def dot_product_attention(
    q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None, causal=True,
    window: int = 0, softcap: float = 0.0, scale: float | None = None,
):  # fmt: skip
    """Plain attention that materialises the [T, S] score matrix: the reference (also for the decode
    kernel, `meshlm.ops.decode`, whose empty cache slots have kv_positions < 0).

    See the module docstring for shapes and the masking rule; `window` (sliding-window attention),
    `softcap` and `scale` as in `attention_mask`, `soft_cap` and `score_scale`. Differentiable by
    ordinary autodiff (the backward recomputes the probabilities from q and k; the output is tagged
    OUT_NAME).
    """
    check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    mask = attention_mask(q_positions, kv_positions, q_segment_ids, kv_segment_ids, causal, window)
    grouped_q = _heads_major(group_queries(q, k.shape[2]))
    scores = jnp.where(mask[:, None, None], _scores(grouped_q, k, scale, softcap), -jnp.inf)
    m = lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m))  # masked -> exactly 0
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)  # a row with nothing to attend stays all 0
    out = _dot("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v)
    return checkpoint_name(ungroup_queries(out).astype(q.dtype), OUT_NAME)


class _Blocks(NamedTuple):
    """Static settings of the blockwise kernel (hashable: a `custom_vjp` nondiff argument)."""

    causal: bool
    block_q: int
    block_kv: int
    skip_masked: bool  # False for one (query block, key block) pair: see `forward_chunk`
    window: int = 0
    softcap: float = 0.0
    scale: float | None = None


def _blockwise_forward(cfg: _Blocks, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    state = forward_chunk(init_state(q), q, k, v, q_pos, kv_pos, q_seg, kv_seg, **cfg._asdict())
    return finalize_state(state, q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(cfg: _Blocks, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    return _blockwise_forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg)[0]


def _blockwise_fwd(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = name_residuals(*_blockwise_forward(cfg, q, k, v, q_pos, kv_pos, q_seg, kv_seg))
    # Residuals are O(T): the inputs, the output and one log-sum-exp per query row.
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _blockwise_bwd(cfg, residuals, dout):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    zeros = (jnp.zeros_like(q, dtype=_F32), jnp.zeros_like(k, dtype=_F32))
    dq, dk, dv = backward_chunk(
        (zeros[0], zeros[1], zeros[1]), q, k, v, q_pos, kv_pos, q_seg, kv_seg,
        dout, lse, output_delta(out, dout), **cfg._asdict(),
    )  # fmt: skip
    # Positions and segment ids are integers: no cotangent.
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(
    q, k, v, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
    causal=True, block_q=512, block_kv=512, window: int = 0, softcap: float = 0.0, scale: float | None = None,
):  # fmt: skip
    """Flash-style attention: online softmax over key blocks, never a [T, S] matrix.

    Same inputs, masking and result as `dot_product_attention` (module docstring). Block sizes
    are clamped to T / S; T and S must then be divisible by them (ValueError otherwise).
    Fully masked (query block, key block) pairs, e.g. above the causal diagonal or outside a
    sliding `window`, are never visited (when there are several; a single pair is computed with no
    conditional): a window of W costs O(T * W).
    The gradient is a `custom_vjp` that recomputes the scores block by block from the saved
    log-sum-exp, so forward + backward memory is linear in T.
    """
    check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    bq, bk = block_sizes(q.shape[1], k.shape[1], block_q, block_kv)
    out = _blockwise(
        _Blocks(bool(causal), bq, bk, (bq, bk) != (q.shape[1], k.shape[1]), int(window), float(softcap),
                None if scale is None else float(scale)),
        group_queries(q, k.shape[2]), k, v,
        q_positions, kv_positions, q_segment_ids, kv_segment_ids,
    )  # fmt: skip
    return ungroup_queries(out)
