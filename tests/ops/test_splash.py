"""Splash attention (TPU Pallas) in interpret mode on CPU equals the blockwise kernel: forward and
gradients, causal, packed documents, grouped queries, lengths padded to its blocks (fp32, atol 1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.ops import kernels
from meshlm.ops.attention import blockwise_attention

ATOL = 1e-5


def _problem(lengths_per_row, heads=4, kv_heads=2, head_dim=32, seed=0):
    """q, k, v, positions (restarting at each document), segment ids, an output cotangent."""
    t = sum(lengths_per_row[0])
    b = len(lengths_per_row)
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, heads, head_dim), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, kv_heads, head_dim), jnp.float32)
    dout = jax.random.normal(ks[3], q.shape, jnp.float32)
    seg = np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in lengths_per_row]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in r]) for r in lengths_per_row]).astype(np.int32)
    return q, k, v, jnp.asarray(pos), jnp.asarray(seg), dout


def _value_and_grads(fn, q, k, v, dout):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(dout))


def _compare(kernel, platform, lengths, packed, **scores):
    """`kernel` through the dispatch against blockwise, with `scores` (window, softcap, scale) given to both."""
    q, k, v, pos, seg, dout = _problem(lengths)
    seg = seg if packed else None
    if not packed:
        pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), pos.shape)
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, **scores)
    t = q.shape[1]
    ref = _value_and_grads(lambda q, k, v: blockwise_attention(q, k, v, **kw, block_q=t, block_kv=t), q, k, v, dout)
    got = _value_and_grads(
        lambda q, k, v: kernels.attention(q, k, v, **kw, kernel=kernel, platform=platform, interpret=True),
        q, k, v, dout,
    )  # fmt: skip
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name)


@pytest.mark.parametrize(
    "lengths, packed",
    [
        ([[256], [256]], False),  # causal, two blocks of the kernel's grid per row
        ([[90, 60, 50], [150, 50]], True),  # packed documents, length 200 padded to 256
    ],
    ids=["causal", "packed_padded"],
)
def test_splash_equals_blockwise(lengths, packed):
    _compare("splash", "tpu", lengths, packed)


def test_splash_picked_by_auto_on_tpu(monkeypatch):
    """`auto` on a TPU runs splash (the kernel is replaced by a recorder to see what is called)."""
    import meshlm.ops.splash as splash

    seen = []

    def fake(q, k, v, segment_ids=None, **kw):
        seen.append((q.shape, None if segment_ids is None else segment_ids.shape, kw["block"]))
        return q

    monkeypatch.setattr(splash, "splash_attention", fake)
    monkeypatch.setattr(kernels, "default_platform", lambda: "tpu")
    q, k, v, pos, seg, _ = _problem([[70, 30]])
    kernels.attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    assert seen == [((1, 128, 4, 32), (1, 128), 128)]  # padded from 100 to one block of 128


@pytest.mark.parametrize(
    "lengths, packed, scores",
    [
        ([[256]], False, dict(window=100)),  # a window shorter than a block: some blocks skipped
        ([[90, 60, 50], [150, 50]], True, dict(window=70, softcap=2.0, scale=0.3)),  # soft cap, scale
    ],
    ids=["window", "window_softcap_scale_packed"],
)
def test_splash_local_mask_and_soft_cap_equal_blockwise(lengths, packed, scores):
    """Splash's LocalMask (window (W-1, 0)) and attn_logits_soft_cap, values and gradients."""
    _compare("splash", "tpu", lengths, packed, **scores)
