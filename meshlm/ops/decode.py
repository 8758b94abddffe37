"""Attention of a decode step: a few new queries against a layer's KV cache, read where it lies.

    q             [B, T, H, D]   the new tokens' queries (usually T = 1)
    k, v          [B, S, K, D]   the cache, H % K == 0 (grouped-query attention)
    q_positions   [B, T] int32   each new token's position
    kv_positions  [B, S] int32   s where slot s holds a token, else -1
    output        [B, T, H, D]   in q's dtype

A query attends the filled slots at or before its own position (and, with a sliding `window` W, fewer
than W positions behind it); softmax in float32, scores scaled (1/sqrt(D) unless `scale` is given) and
optionally soft-capped (`softcap`), as in `meshlm.ops.attention.dot_product_attention`.
"""

from __future__ import annotations

import jax.numpy as jnp

from meshlm.ops.attention import score_scale, soft_cap
from meshlm.ops.attention_masks import attention_mask


def decode_attention(q, k_cache, v_cache, q_positions, kv_positions, *, window=0, softcap=0.0, scale=None):
    """New queries [B, T, H, D] against the whole cache [B, S, K, D]; empty and future slots are masked.

    Both products are plain matmuls over the cache as it lies, [B, S, K·D], against the queries laid
    out block-diagonally ([B, K·D, T·H]: head h's query fills the rows of its kv head only). A matmul
    with kv heads as a batch dimension would first copy the whole cache into a heads-major layout,
    every layer and every step; the block-diagonal form reads it once, in place, for K times the
    (few) multiply-adds. With the cache's length split over the mesh, each shard scores its own
    slots and the softmax reductions cross the shards: sequence-parallel decoding without gathering
    the cache."""
    B, T, H, D = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    f32 = jnp.float32
    eye = jnp.eye(K, dtype=f32)
    qg = q.astype(f32).reshape(B, T, K, G, D) * score_scale(scale, D)
    q_blocks = jnp.einsum("btjgd,kj->bkdtjg", qg, eye).reshape(B, K * D, T * H)
    scores = jnp.einsum("bsx,bxy->bsy", k_cache.reshape(B, S, K * D).astype(f32), q_blocks)  # [B, S, T·H]
    scores = soft_cap(scores, softcap)
    allowed = jnp.swapaxes(attention_mask(q_positions, kv_positions, None, None, True, window), 1, 2)  # [B, S, T]
    scores = jnp.where(allowed[..., None], scores.reshape(B, S, T, H), -jnp.inf)
    top = jnp.max(scores, axis=1, keepdims=True)
    p = jnp.exp(scores - jnp.where(top == -jnp.inf, 0.0, top))  # masked slots: exactly 0
    total = jnp.sum(p, axis=1, keepdims=True)
    p = (p / jnp.where(total > 0, total, 1.0)).reshape(B, S, T * H)
    mixed = jnp.einsum("bsy,bsx->byx", p, v_cache.reshape(B, S, K * D).astype(f32))  # [B, T·H, K·D]
    out = jnp.einsum("btkgjd,kj->btkgd", mixed.reshape(B, T, K, G, K, D), eye)  # each head's own kv head
    return out.reshape(B, T, H, D).astype(q.dtype)


__all__ = ["decode_attention"]
