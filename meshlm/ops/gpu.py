"""GPU attention: cuDNN flash attention, and the Pallas (Triton) flash kernel for packed documents.

Both take one device's arrays in the layout of `meshlm.ops.attention` (q [B,T,H,D], k/v [B,T,KVH,D])
and return [B,T,H,D] in q's dtype, masking by index (causal self-attention). Neither contains an XLA
`conditional`: each is one fused kernel per pass, with its own block skipping.

- `cudnn_attention`: `jax.nn.dot_product_attention(implementation="cudnn")`. Grouped queries native;
  bfloat16/float16 only; no segment ids (the public call has no packed-document form).
- `triton_attention`: `jax.experimental.pallas.ops.gpu.attention.mha`, which masks segment ids and
  runs in any dtype. It has no grouped queries: k and v are repeated to the query heads (the
  gradient sums the copies back).

`interpret=True` runs cudnn's call as its XLA implementation and the Triton kernel in Pallas
interpret mode, on any backend: how their use here is tested on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TRITON_BLOCK = 128  # the Triton kernel's forward block (queries and keys); lengths are padded to it


def cudnn_attention(q, k, v, segment_ids=None, *, block: int | None = None, causal: bool = True,
                    interpret: bool = False):
    """cuDNN flash attention (scale 1/sqrt(D)); `segment_ids` must be None, `block` is not used."""
    del block
    if segment_ids is not None:
        raise ValueError("cuDNN attention has no segment-id mask here; use triton_attention")
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla" if interpret else "cudnn")
    return out.astype(q.dtype)


def triton_attention(q, k, v, segment_ids=None, *, block: int = TRITON_BLOCK, causal: bool = True,
                     interpret: bool = False):
    """The Pallas (Triton) flash kernel, with the segment-id mask; T must be a multiple of `block`."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

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
    out = pallas_gpu.mha(q, k, v, segment_ids, sm_scale=1.0 / d**0.5, causal=causal, block_sizes=blocks,
                         interpret=interpret)  # fmt: skip
    return out.astype(q.dtype)
