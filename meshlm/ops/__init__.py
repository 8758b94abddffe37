"""Attention kernels.

- `attention.dot_product_attention`: plain attention (the reference; decode against a KV cache).
- `attention.blockwise_attention`: flash-style attention, memory linear in T (sp = 1).
- `ring.ring_attention`: RingAttention with the sequence sharded over a mesh axis (sp > 1),
  with `ring.zigzag_permutation` / `ring.inverse_permutation` to balance causal work.
"""

from meshlm.ops.attention import blockwise_attention, dot_product_attention
from meshlm.ops.ring import inverse_permutation, ring_attention, zigzag_permutation

__all__ = [
    "blockwise_attention",
    "dot_product_attention",
    "inverse_permutation",
    "ring_attention",
    "zigzag_permutation",
]
