"""TPU attention: Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`).

`splash_attention(q, k, v, segment_ids)` takes one device's arrays in the layout of
`meshlm.ops.attention` (q [B,T,H,D], k/v [B,T,KVH,D], segment ids [B,T] or None) and returns
[B,T,H,D]. Causal (or full) masking by index, and the segment-id mask for packed documents; grouped
queries are served natively (query head h reads kv head h // (H // KVH), never a copy). A sliding
window W is splash's `LocalMask` (window (W-1, 0)), whose block mask skips blocks outside it; a soft
cap is its `attn_logits_soft_cap`.

The kernel works per example on heads-major arrays ([H,T,D]); it is vmapped over the batch. The
length must be a multiple of the block (`meshlm.ops.kernels` pads it). The kernel does not scale the
scores: q is multiplied by the scale (1/sqrt(D) unless given) first. Its residuals carry the
`OUT_NAME` checkpoint name. The block mask is built once per (heads, length, block, window) in NumPy
and closed over as constants.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.ops.attention import OUT_NAME, score_scale

MAX_BLOCK = 512


def _blocks(block: int):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return sa.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        use_fused_bwd_kernel=True,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, length: int, block: int, causal: bool, interpret: bool, window: int = 0, softcap: float = 0.0):
    """The splash kernel for [heads, length, D] queries (MHA form: kv heads may be fewer)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (length, length)
    if window:  # keys at most window - 1 behind (and, if causal, none ahead)
        one = sa.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=0)
    else:
        one = sa.CausalMask(shape) if causal else sa.FullMask(shape)
    mask = sa.MultiHeadMask([one] * heads)
    # Built while tracing but cached across traces: its mask arrays must be constants, not tracers.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(
            mask, block_sizes=_blocks(block), head_shards=1, q_seq_shards=1,
            residual_checkpoint_name=OUT_NAME, interpret=interpret, attn_logits_soft_cap=softcap or None,
        )  # fmt: skip


def splash_attention(
    q, k, v, segment_ids=None, *, block: int = MAX_BLOCK, causal: bool = True, interpret: bool = False,
    window: int = 0, softcap: float = 0.0, scale: float | None = None,
):  # fmt: skip
    """Splash attention of one device's q [B,T,H,D] to k, v [B,T,KVH,D]: [B,T,H,D] in q's dtype.

    T must be a multiple of `block`, itself a multiple of 128 (`meshlm.ops.kernels` pads to one).
    `segment_ids` [B,T] int32 (or None) masks attention across packed documents. `interpret` runs the
    Pallas kernel in interpret mode (any backend; slow): how it is tested on CPU. `window`, `softcap`
    and `scale` as in `meshlm.ops.attention.dot_product_attention`.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, t, h, d = q.shape
    if t % block or block % 128:
        raise ValueError(f"splash attention needs a length ({t}) divisible by a block ({block}) of 128s")
    qh = jnp.swapaxes(q * jnp.asarray(score_scale(scale, d), q.dtype), 1, 2)  # [B,T,N,D] -> [B,N,T,D]
    kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    kernel = _kernel(h, t, block, bool(causal), bool(interpret), int(window), float(softcap))
    if segment_ids is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v))(qh, kh, vh)
    else:
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(qh, kh, vh, segment_ids)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)
