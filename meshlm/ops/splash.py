"""TPU attention: Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`).

`splash_attention(q, k, v, segment_ids)` takes one device's arrays in the layout of
`meshlm.ops.attention` (q [B,T,H,D], k/v [B,T,KVH,D], segment ids [B,T] or None) and returns
[B,T,H,D]. Causal (or full) masking by index, and the segment-id mask for packed documents; grouped
queries are served natively (query head h reads kv head h // (H // KVH), never a copy).

The kernel works per example on heads-major arrays ([H,T,D]); it is vmapped over the batch. The
length must be a multiple of the block (`meshlm.ops.kernels` pads it). The kernel does not scale the
scores: q is multiplied by 1/sqrt(D) first. Its residuals (output and log-sum-exp) carry the
`OUT_NAME` checkpoint name, so the remat policies that save attention keep them.

The block mask is built once per (heads, length, block) in NumPy and closed over as constants.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.ops.attention import OUT_NAME

MAX_BLOCK = 512


def _blocks(block: int):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return sa.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        use_fused_bwd_kernel=True,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, length: int, block: int, causal: bool, interpret: bool):
    """The splash kernel for [heads, length, D] queries (MHA form: kv heads may be fewer)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    one = sa.CausalMask((length, length)) if causal else sa.FullMask((length, length))
    mask = sa.MultiHeadMask([one] * heads)
    # Built while tracing but cached across traces: its mask arrays must be constants, not tracers.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(
            mask, block_sizes=_blocks(block), head_shards=1, q_seq_shards=1,
            residual_checkpoint_name=OUT_NAME, interpret=interpret,
        )  # fmt: skip


def splash_attention(
    q, k, v, segment_ids=None, *, block: int = MAX_BLOCK, causal: bool = True, interpret: bool = False
):
    """Splash attention of one device's q [B,T,H,D] to k, v [B,T,KVH,D]: [B,T,H,D] in q's dtype.

    T must be a multiple of `block`, itself a multiple of 128 (`meshlm.ops.kernels` pads to one).
    `segment_ids` [B,T] int32 (or None) masks attention across packed documents. `interpret` runs the
    Pallas kernel in interpret mode (any backend; slow): how it is tested on CPU.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, h, d = q.shape
    if t % block or block % 128:
        raise ValueError(f"splash attention needs a length ({t}) divisible by a block ({block}) of 128s")
    qh = jnp.swapaxes(q * jnp.asarray(1.0 / d**0.5, q.dtype), 1, 2)  # [B,T,N,D] -> [B,N,T,D]
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    kernel = _kernel(h, t, block, bool(causal), bool(interpret))
    if segment_ids is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v))(qh, kh, vh)
    else:
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(qh, kh, vh, segment_ids)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)
