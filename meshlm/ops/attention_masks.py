"""Which (query, key) pairs attention may use: the input checks, the mask of one block of pairs and,
from each block's ranges of positions and segment ids, the table of blocks worth visiting.

A query attends a key when the key slot holds a token (position >= 0), (if causal) the key is not
ahead, (with a sliding window W) the key is less than W positions behind (q_pos - kv_pos < W), and
(if given) both are in the same document. `meshlm.ops.attention` has the shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

_INT_MAX = jnp.iinfo(jnp.int32).max


def check_inputs(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids) -> None:
    """Raise ValueError for shapes that do not fit together (the shapes of `meshlm.ops.attention`)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got {q.shape}, {k.shape}, {v.shape}")
    b, t, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} in batch or head dim")
    if h % k.shape[2]:
        raise ValueError(f"query heads {h} are not a multiple of kv heads {k.shape[2]}")
    if q_positions.shape != (b, t) or kv_positions.shape != (b, k.shape[1]):
        raise ValueError(f"positions must be [B, T] and [B, S]; got {q_positions.shape}, {kv_positions.shape}")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None and (
        q_segment_ids.shape != q_positions.shape or kv_segment_ids.shape != kv_positions.shape
    ):
        raise ValueError("segment ids must have the shapes of the positions")


def attention_mask(q_pos, kv_pos, q_seg, kv_seg, causal: bool, window: int = 0) -> Array:
    """[B, tq], [B, tk] -> bool [B, tq, tk], True where the query may attend the key.

    `window` W > 0 keeps only keys less than W positions behind the query (q_pos - kv_pos < W:
    a query at p sees p-W+1 .. p when causal), transformers' sliding-window convention."""
    mask = (kv_pos >= 0)[:, None, :]
    if causal:
        mask = mask & (kv_pos[:, None, :] <= q_pos[:, :, None])
    if window:
        mask = mask & (q_pos[:, :, None] - kv_pos[:, None, :] < window)
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
    return mask


def _ranges(x, size: int, valid=None):
    """[B, n*size] -> (min, max) over each block of `size`, [B, n], of the entries where `valid`
    ([B, n*size] bool; None: all); a block with no valid entry gets (INT_MAX, -1)."""
    b = x.shape[0]
    x = x.reshape(b, -1, size)
    if valid is None:
        return jnp.min(x, axis=-1), jnp.max(x, axis=-1)
    valid = valid.reshape(x.shape)
    return jnp.min(jnp.where(valid, x, _INT_MAX), axis=-1), jnp.max(jnp.where(valid, x, -1), axis=-1)


def block_table(q_pos, kv_pos, q_seg, kv_seg, causal: bool, window: int, block_q: int, block_kv: int) -> Array:
    """bool [T // block_q, S // block_kv]: False only where *every* (query, key) pair of a block is masked.

    Compares each block's ranges of positions and segment ids, so it costs O(T/bq * S/bk) (never
    O(T * S)) and holds for tokens in any order. It may say True for a block that turns out to be
    fully masked (then the block is computed and masked as usual), but never False for a block
    with a pair to attend. The whole batch shares one answer.
    """
    valid = kv_pos >= 0
    k_lo, k_hi = (r[:, None, :] for r in _ranges(kv_pos, block_kv, valid))  # [B, 1, nk]
    q_lo, q_hi = (r[:, :, None] for r in _ranges(q_pos, block_q))  # [B, nq, 1]
    ok = jnp.any(valid.reshape(k_lo.shape[0], 1, -1, block_kv), axis=-1)  # some key slot holds a token
    if causal:
        ok = ok & (k_lo <= q_hi)
    if window:  # some key less than `window` behind some query
        ok = ok & (k_hi > q_lo - window)
    if q_seg is not None:  # the id ranges overlap
        qs_lo, qs_hi = (r[:, :, None] for r in _ranges(q_seg, block_q))
        ks_lo, ks_hi = (r[:, None, :] for r in _ranges(kv_seg, block_kv))
        ok = ok & (qs_lo <= ks_hi) & (ks_lo <= qs_hi)
    return jnp.any(ok, axis=0)


def block_may_attend(q_pos, kv_pos, q_seg, kv_seg, causal: bool, window: int = 0) -> Array:
    """Scalar bool: False only if *every* (query, key) pair of the block is masked (`block_table`
    with the whole block as one)."""
    return block_table(q_pos, kv_pos, q_seg, kv_seg, causal, window, q_pos.shape[1], kv_pos.shape[1])[0, 0]


def key_block_lists(table):
    """[nq, nk] block table -> (order [nq, nk]: each row's key blocks to visit first, ascending,
    count [nq]: how many there are). Looping over `order[i, :count[i]]` visits only the blocks
    that may attend, so a sliding window costs O(T * W), not a pass over every key block."""
    count = jnp.sum(table, axis=1, dtype=jnp.int32)
    order = jnp.argsort(jnp.logical_not(table), axis=1, stable=True).astype(jnp.int32)
    return order, count
