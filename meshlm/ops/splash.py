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
import math

import jax
import jax.numpy as jnp

from meshlm.ops.attention import OUT_NAME, score_scale

MAX_BLOCK = 512
# A row whose log-sum-exp is below this attended nothing (splash's mask value is -0.7 x float32 max).
MASKED_LSE = -1e37


def _blocks(block: int):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return sa.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        use_fused_bwd_kernel=True,
    )  # fmt: skip


def _mask(q_len: int, kv_len: int, causal: bool, window: int, offset: int | None):
    """Splash's mask of queries at local index i to keys at j whose sequence distance is offset + i - j
    (`offset` None: every pair is in reach, e.g. a ring chunk wholly behind the queries)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (q_len, kv_len)
    if window:  # keys at most window - 1 behind (and, if causal, none ahead)
        return sa.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=offset or 0)
    if causal and offset is not None:
        return sa.CausalMask(shape, offset=offset)
    return sa.FullMask(shape)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, length: int, block: int, causal: bool, interpret: bool, window: int = 0, softcap: float = 0.0,
            kv_length: int | None = None, offset: int | None = 0, save_residuals: bool = False):  # fmt: skip
    """The splash kernel for [heads, length, D] queries (MHA form: kv heads may be fewer) to `kv_length`
    keys (default `length`) at index `offset` (`_mask`); `save_residuals` also returns the log-sum-exp."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    mask = sa.MultiHeadMask([_mask(length, kv_length or length, causal, window, offset)] * heads)
    # Built while tracing but cached across traces: its mask arrays must be constants, not tracers.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(
            mask, block_sizes=_blocks(block), head_shards=1, q_seq_shards=1, save_residuals=save_residuals,
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


# --------------------------------------------------------------------------------------------
# One ring chunk: the forward with its log-sum-exp, the backward from the whole ring's residuals
# --------------------------------------------------------------------------------------------


def chunk_block(length: int) -> int:
    """The largest splash block (a multiple of 128, at most MAX_BLOCK) dividing `length`; 0 if none does."""
    return next((b for b in range(MAX_BLOCK, 0, -128) if length % b == 0), 0)


def _chunk_kernel(q, k, offset, cfg: dict, save_residuals: bool):
    block = chunk_block(math.gcd(q.shape[1], k.shape[1]))
    return _kernel(q.shape[2], q.shape[1], block, cfg["causal"], cfg["interpret"], cfg["window"], cfg["softcap"],
                   kv_length=k.shape[1], offset=offset, save_residuals=save_residuals)  # fmt: skip


def _heads(x):
    return None if x is None else jnp.swapaxes(x, 1, 2)  # [B,T,N,D] <-> [B,N,T,D]


def _segments(q_seg, kv_seg):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return None if q_seg is None else sa.SegmentIds(q_seg, kv_seg)


def splash_chunk_forward(q, k, v, q_seg, kv_seg, *, offset: int | None, cfg: dict):
    """Attention of pre-scaled q [B,T,H,D] to one chunk k, v [B,S,KVH,D] whose keys lie `offset` positions
    behind the queries' (`_mask`): (out [B,T,H,D] in q's dtype, lse [B,H,T] float32). `cfg`: causal,
    window, softcap, interpret. A row with no key to attend gets lse -inf and out 0."""
    kernel = _chunk_kernel(q, k, offset, cfg, save_residuals=True)
    run = lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=_segments(qs, ks))  # noqa: E731
    out, (lse,) = jax.vmap(run)(_heads(q), _heads(k), _heads(v), q_seg, kv_seg)
    # Splash leaves a masked row at its mask value (or, with no block visited, 0 / 0): no weight.
    lse = jnp.where(lse > MASKED_LSE, lse, -jnp.inf)
    return jnp.where(jnp.isfinite(lse)[..., None], out, 0).swapaxes(1, 2), lse


def splash_chunk_backward(q, k, v, q_seg, kv_seg, out, lse, dout, *, offset: int | None, cfg: dict):
    """This chunk's exact share of (dq, dk, dv) (float32, for pre-scaled q), given the output `out`, its
    cotangent `dout` [B,T,H,D] and log-sum-exp `lse` [B,H,T] of the attention to *all* keys."""
    kernel = _chunk_kernel(q, k, offset, cfg, save_residuals=False)
    lse = jnp.where(jnp.isfinite(lse), lse, jnp.finfo(jnp.float32).max)  # nothing attended: p = 0

    def run(q, k, v, qs, ks, out, lse, dout):
        return _splash_backward(kernel, q, k, v, _segments(qs, ks), out, lse, dout)

    grads = jax.vmap(run)(_heads(q), _heads(k), _heads(v), q_seg, kv_seg, _heads(out), lse, _heads(dout))
    return tuple(_heads(g).astype(jnp.float32) for g in grads)


def _splash_backward(kernel, q, k, v, segment_ids, out, lse, dout):
    """Splash's backward kernels ([N,T,D] arrays of one example) on the given residuals: (dq, dk, dv).

    Read from jax 0.12.0.1 (`splash_attention_kernel._splash_attention_bwd`, the custom VJP's backward
    rule, whose residuals are (q, k, v, segment_ids, sinks, out, logsumexp, dq_mask_info,
    dkv_mask_info)); a change there breaks here only. Its delta is rowsum(out * dout) of the `out` given."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as impl

    def collapse(info):  # as `impl._splash_attention` does before its custom VJP
        if info is None or info.partial_mask_blocks is None:
            return info
        return info._replace(
            partial_mask_blocks=info.partial_mask_blocks.reshape(-1, *info.partial_mask_blocks.shape[-2:])
        )

    kw = kernel.kwargs
    res = (q, k, v, segment_ids, None, out, lse, collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info))
    grads = impl._splash_attention_bwd(
        False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
        kw["attn_logits_soft_cap"], kw["interpret"], res, dout,
    )  # fmt: skip
    return grads[3:6]
