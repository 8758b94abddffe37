"""GPU attention: cuDNN flash attention, and the Pallas (Triton) flash kernel for packed documents.

Both take one device's arrays in the layout of `meshlm.ops.attention` (q [B,T,H,D], k/v [B,T,KVH,D])
and return [B,T,H,D] in q's dtype, masking by index (causal self-attention). Neither contains an XLA
`conditional`: each is one fused kernel per pass, with its own block skipping.

- `cudnn_attention`: `jax.nn.dot_product_attention(implementation="cudnn")`. Grouped queries native,
  sliding windows, no soft cap; bfloat16/float16 only. With segment ids it runs cuDNN's packed layout
  (`cudnn_packed_attention`: each document's offset and length, Hopper and later).
- `triton_attention`: `jax.experimental.pallas.ops.gpu.attention.mha`, which masks segment ids and
  runs in any dtype; no sliding window, no soft cap, no grouped queries: k and v are repeated to the
  query heads (the gradient sums the copies back).

`interpret=True` runs cudnn's call as its XLA implementation and the Triton kernel in Pallas
interpret mode, on any backend: how their use here is tested on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TRITON_BLOCK = 128  # the Triton kernel's forward block (queries and keys); lengths are padded to it
# cuDNN's packed layout: the most documents one row holds, unless the caller says (`--model.max_documents`,
# whose default this is; see `cudnn_packed_attention` for what it costs).
MAX_DOCUMENTS = 8


def triton_block(dtype, head_dim: int) -> int:
    """The Triton kernel's forward block for these operands: TRITON_BLOCK, halved for float32 heads over
    64 wide (float32 blocks of 128 x 128 need 257 KiB of shared memory; an H200 has 227)."""
    return TRITON_BLOCK // 2 if jnp.dtype(dtype).itemsize >= 4 and head_dim > 64 else TRITON_BLOCK


def cudnn_attention(
    q,
    k,
    v,
    segment_ids=None,
    *,
    block: int | None = None,
    causal: bool = True,
    interpret: bool = False,
    max_documents: int = MAX_DOCUMENTS,
    window: int = 0,
    softcap: float = 0.0,
    scale: float | None = None,
):
    """cuDNN flash attention (scale 1/sqrt(D) unless given); with `segment_ids`, over packed documents
    (`cudnn_packed_attention`). A sliding `window` W is cuDNN's local window (W-1 keys behind, none
    ahead). `block` is not used; cuDNN has no soft cap (`softcap` must be 0). `interpret`: the same
    masks through XLA."""
    del block
    if softcap:
        raise ValueError("cuDNN attention has no logit soft cap")
    scale = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    local = (window - 1, 0) if window else None
    if interpret:
        mask = None
        if segment_ids is not None:
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
        out = jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=causal, scale=scale, local_window_size=local, implementation="xla"
        )
    elif segment_ids is not None:
        out = cudnn_packed_attention(
            q, k, v, segment_ids, max_segments=max_documents, causal=causal, window=window, scale=scale
        )
    else:
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, local_window_size=local, implementation="cudnn"
        )
    return out.astype(q.dtype)


def triton_attention(
    q, k, v, segment_ids=None, *, block: int | None = None, causal: bool = True, interpret: bool = False,
    window: int = 0, softcap: float = 0.0, scale: float | None = None,
):  # fmt: skip
    """The Pallas (Triton) flash kernel, with the segment-id mask and `scale` (1/sqrt(D) unless given);
    T must be a multiple of `block` (default `triton_block`). The kernel has neither a sliding window
    nor a soft cap: `window` and `softcap` must be 0."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    if window or softcap:
        raise ValueError("the Triton attention kernel has no sliding window and no soft cap")

    block = block or triton_block(q.dtype, q.shape[-1])
    t, heads, d = q.shape[1], q.shape[2], q.shape[3]
    if t % block:
        raise ValueError(f"the Triton kernel needs a length ({t}) divisible by its block ({block})")
    group = heads // k.shape[2]
    if group > 1:
        k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    backward = min(32, block)
    blocks = pallas_gpu.BlockSizes(
        block_q=block, block_k=block, block_q_dkv=backward, block_kv_dkv=backward,
        block_q_dq=backward, block_kv_dq=backward,
    )  # fmt: skip
    sm_scale = 1.0 / d**0.5 if scale is None else scale
    out = pallas_gpu.mha(q, k, v, segment_ids, sm_scale=sm_scale, causal=causal, block_sizes=blocks,
                         interpret=interpret)  # fmt: skip
    return out.astype(q.dtype)


def segment_offsets(segment_ids, max_segments: int):
    """(seqlens [B, M], offsets [B, M + 1]) of the documents in each row of `segment_ids` [B, T], in the
    form cuDNN's packed layout takes: document m of a row starts at offsets[m] and holds seqlens[m]
    tokens; entries past a row's last document are -1. A document starts wherever the id changes. Rows
    with more than M documents keep their first M - 1 and merge the rest into the M-th (so every token
    stays covered; that last segment then attends across its documents: choose M above the most
    documents a row can hold)."""
    b, t = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    index = jnp.minimum(jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, max_segments - 1)  # [B, T]
    rows = jnp.arange(b)[:, None]
    counts = jnp.zeros((b, max_segments), jnp.int32).at[rows, index].add(1)
    first = jnp.full((b, max_segments + 1), t, jnp.int32).at[rows, index].min(jnp.arange(t, dtype=jnp.int32))
    seqlens = jnp.where(counts > 0, counts, -1)
    offsets = jnp.where(first < t, first, -1)
    return seqlens, offsets


def cudnn_packed_attention(
    q, k, v, segment_ids, *, max_segments: int = MAX_DOCUMENTS, causal: bool = True, window: int = 0,
    scale: float | None = None,
):  # fmt: skip
    """cuDNN flash attention over packed documents (Hopper and later): the rows' documents, read from
    `segment_ids` [B, T], are passed as cuDNN's packed layout (per-document lengths and offsets), each
    attending causally within itself (within its last `window` tokens if given; cuDNN's sliding
    window length, as `jax.nn.dot_product_attention` passes it). Runs on a GPU only (no XLA twin).

    cuDNN's backward takes a float32 workspace of [B x max_segments, T, heads, head_dim], and its time
    grows with it too (docs/kernels.md measures both): keep max_segments near the documents a row holds."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    seqlens, offsets = segment_offsets(segment_ids, max_segments)
    mask = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
    scale = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    out = cudnn.dot_product_attention(q, k, v, None, None, seqlens, seqlens, offsets, offsets, scale=scale,
                                      mask_type=mask, sliding_window_length=window or None)  # fmt: skip
    return out.astype(q.dtype)
