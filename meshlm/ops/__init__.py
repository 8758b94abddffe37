"""Kernels: pure functions of arrays, below the model (they know neither the model nor the mesh's names).

- `attention`: plain dot-product attention (the reference) and the blockwise (flash-style) kernel.
- `ring`: RingAttention with the sequence sharded over a mesh axis, and the zigzag load balancing.
- `decode`: a decode step's attention against a KV cache.
- `linear`: the weight projections: compute-dtype matmuls with their backward written out.
- `pipeline`: the pipeline schedules (GPipe, 1F1B, interleaved) and their executor over `pp`.

Import the module you need (`from meshlm.ops.attention import dot_product_attention`).
"""
