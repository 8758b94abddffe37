"""Attention inputs and the reference they are checked against: plain dense attention's value and
gradients (meshlm.ops.attention.dot_product_attention), compared at fp32 tolerance."""

import jax
import numpy as np

from meshlm.ops.attention import dot_product_attention

ATOL = 1e-5  # fp32: the blockwise result must equal the reference to this absolute tolerance


def make_inputs(seed, *, b=2, t=128, h=4, kvh=2, d=16, packed=False):
    """q, k, v, an output cotangent, positions and (if packed) segment ids.

    Packed rows hold several documents with positions restarting at 0 in each, then a few
    padding tokens (position -1) whose rows have nothing to attend.
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d), np.float32)
    k = rng.standard_normal((b, t, kvh, d), np.float32)
    v = rng.standard_normal((b, t, kvh, d), np.float32)
    dout = rng.standard_normal((b, t, h, d), np.float32)
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    seg = None
    if packed:
        seg = np.zeros((b, t), np.int32)
        for row in range(b):
            cuts = np.sort(rng.choice(np.arange(1, t - 8), size=3, replace=False))
            bounds = [0, *cuts, t - 8]
            for doc, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                seg[row, lo:hi] = doc + 1
                pos[row, lo:hi] = np.arange(hi - lo)
            pos[row, t - 8 :] = -1  # padding: segment 0, no position
    return q, k, v, dout, pos, seg


def value_and_grads(fn, q, k, v, dout, pos, seg, causal, **kw):
    def f(q, k, v):
        return fn(
            q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
            causal=causal, **kw,
        )  # fmt: skip

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(dout))


reference = jax.jit(
    lambda q, k, v, dout, pos, seg, causal: value_and_grads(dot_product_attention, q, k, v, dout, pos, seg, causal),
    static_argnames="causal",
)


def assert_all_close(got, want, atol=ATOL):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=0, err_msg=name)
