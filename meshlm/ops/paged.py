"""Attention over a paged KV cache, and writing new tokens into its pages.

    k_pages, v_pages  [P, block_size, K, D]  one layer's pages, shared by every sequence
    block_tables      [B, max_blocks] int32  row b's blocks in order (past its length: any valid block)
    context_lens      [B] int32              tokens row b holds, this step's included
    slot_mapping      [N] int32              flat slot block · block_size + offset per new token, -1 skips

`paged_decode_attention` is the reference on every backend: it gathers each row's blocks into a
contiguous [B, max_blocks · block_size, K, D] cache and runs `meshlm.ops.decode.decode_attention`
with the positions the table holds, so the masking rules (causal, window, soft cap, scale) are that
module's. `ring=True` reads a sliding-window layer's table as a ring (position p in logical slot
p mod (max_blocks · block_size), like `meshlm.models.layers.LayerCache`). `ragged_paged_attention_tpu`
calls JAX's Pallas TPU ragged paged attention kernel on the same arguments (TPU only);
`paged_attention_gpu` JAX's Pallas GPU paged decode kernel (one query per row, no window). docs/paged.md.
"""

from __future__ import annotations

import jax.numpy as jnp

from meshlm.ops.attention import score_scale
from meshlm.ops.decode import decode_attention


def write_pages(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Store the new tokens' keys and values [N, K, D] at their flat slots [N] (-1: not written);
    returns the updated (k_pages, v_pages), in place when the pages are donated."""
    pages, size = k_pages.shape[:2]
    slots = jnp.where(slot_mapping < 0, pages * size, slot_mapping)  # past the end: dropped

    def put(cache, new):
        flat = cache.reshape(pages * size, *cache.shape[2:])
        flat = flat.at[slots].set(new.astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)

    return put(k_pages, k_new), put(v_pages, v_new)


def copy_blocks(k_pages, v_pages, copies):
    """Run copy-on-write block copies: copies [C, 2] int32 (source, destination) rows; returns the
    updated (k_pages, v_pages). Destinations are distinct; no source is also a destination."""
    source, destination = copies[:, 0], copies[:, 1]
    return k_pages.at[destination].set(k_pages[source]), v_pages.at[destination].set(v_pages[source])


def gather_pages(pages, block_tables):
    """[P, block_size, K, D] pages, [B, n] table -> the rows' contiguous caches [B, n · block_size, K, D]."""
    b, n = block_tables.shape
    return pages[block_tables].reshape(b, n * pages.shape[1], *pages.shape[2:])


def table_positions(context_lens, slots: int, ring: bool = False):
    """[B, slots] int32: the position each logical slot of a row's table holds once its first
    `context_lens` tokens are written (-1: empty), as `meshlm.models.layers.cache_positions`."""
    newest = (context_lens.astype(jnp.int32) - 1)[:, None]
    index = jnp.arange(slots, dtype=jnp.int32)[None, :]
    held = newest - (newest - index) % slots if ring else index
    return jnp.where((held >= 0) & (held <= newest), held, -1)


def paged_decode_attention(
    q, k_pages, v_pages, block_tables, context_lens, q_positions, *, window=0, softcap=0.0, scale=None, ring=False
):
    """New queries [B, T, H, D] at `q_positions` [B, T] against each row's pages: [B, T, H, D]."""
    k_cache, v_cache = gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables)
    kv_positions = table_positions(context_lens, k_cache.shape[1], ring)
    return decode_attention(q, k_cache, v_cache, q_positions, kv_positions, window=window, softcap=softcap, scale=scale)


def combine_kv_pages(k_pages, v_pages):
    """[P, bs, K, D] twice -> [P, bs, 2K, D], kv head k's key at 2k and value at 2k + 1: the layout the
    TPU ragged kernel reads (one DMA per page brings both)."""
    p, size, heads, dim = k_pages.shape
    return jnp.stack([k_pages, v_pages], axis=3).reshape(p, size, 2 * heads, dim)


def ragged_inputs(q, block_tables, context_lens):
    """The TPU ragged kernel's arguments for queries [B, T, H, D] that are each row's last T tokens:
    (queries [B·T, H, D], kv_lens [B], page_indices [B, n], cu_q_lens [B+1], num_seqs [1])."""
    b, t = q.shape[:2]
    cu_q_lens = jnp.arange(b + 1, dtype=jnp.int32) * t
    num_seqs = jnp.array([b], jnp.int32)
    flat = q.reshape(b * t, *q.shape[2:])
    return flat, context_lens.astype(jnp.int32), block_tables.astype(jnp.int32), cu_q_lens, num_seqs


def ragged_kernel():
    """JAX's Pallas TPU ragged paged attention, or None when the installed JAX has none."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    except ImportError:
        return None
    return ragged_paged_attention


def ragged_paged_attention_tpu(
    q, k_pages, v_pages, block_tables, context_lens, *, window=0, softcap=0.0, scale=None, kernel=None
):
    """`paged_decode_attention` on TPU for queries that are each row's last T tokens (decode, or a
    chunk of prefill ending at the row's length), through the ragged kernel (`kernel`: that function
    or one with its signature, such as JAX's pure-JAX reference). Linear tables only: the kernel reads
    position p in the table's block p // block_size, so a sliding-window layer keeps a linear table
    whose blocks behind the window may point anywhere (the window masks them)."""
    kernel = kernel or ragged_kernel()
    if kernel is None:
        raise NotImplementedError("this JAX has no Pallas TPU ragged paged attention kernel")
    b, t, h, d = q.shape
    flat, kv_lens, page_indices, cu_q_lens, num_seqs = ragged_inputs(q, block_tables, context_lens)
    out = kernel(
        flat,
        combine_kv_pages(k_pages, v_pages),
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=score_scale(scale, d),
        sliding_window=window or None,
        soft_cap=softcap or None,
    )
    return out[: b * t].reshape(b, t, h, d)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def paged_attention_gpu(
    q, k_pages, v_pages, block_tables, context_lens, *, softcap=0.0, scale=None, interpret=False, k_splits=16
):
    """`paged_decode_attention` for one query per row at its newest position (q [B, 1, H, D]) through
    JAX's Pallas GPU paged attention (Triton): no window, so global layers only. The kernel reads
    heads-major pages [K, P, block_size, D] (transposed here: a cache kept for it would be stored so)
    and splits each row's table into up to `k_splits` parts whose partial softmaxes it merges."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, t, h, d = q.shape
    if t != 1:
        raise NotImplementedError(f"the GPU paged kernel takes one query per row, not {t}")
    splits = _largest_divisor(block_tables.shape[1], k_splits)
    per_split = block_tables.shape[1] // splits
    out = paged_attention(
        (q[:, 0].astype(jnp.float32) * score_scale(scale, d)).astype(q.dtype),
        jnp.transpose(k_pages, (2, 0, 1, 3)),
        jnp.transpose(v_pages, (2, 0, 1, 3)),
        block_tables.astype(jnp.int32),
        context_lens.astype(jnp.int32),
        k_splits=splits,
        pages_per_compute_block=_largest_divisor(per_split, 8),
        attn_logits_soft_cap=softcap or None,
        interpret=interpret,
    )
    return out.reshape(b, 1, h, d)


__all__ = [
    "combine_kv_pages",
    "copy_blocks",
    "gather_pages",
    "paged_attention_gpu",
    "paged_decode_attention",
    "ragged_inputs",
    "ragged_kernel",
    "ragged_paged_attention_tpu",
    "table_positions",
    "write_pages",
]
