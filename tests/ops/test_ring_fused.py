"""RingAttention with splash per chunk (Pallas interpret mode on simulated CPU devices) equals full dense
attention, values and gradients (fp32, atol 1e-5): contiguous and zigzag order, causal, windows shorter
and longer than a chunk, packed documents. On TPU (compiled ahead of time with libtpu) the fused ring
has no XLA conditional. Other calls keep the blockwise ring."""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.ops import ring_fused
from meshlm.ops.attention import dot_product_attention
from meshlm.ops.ring import fused_kernel, ring_attention, zigzag_permutation
from tests.support.attention import assert_all_close, value_and_grads

SPEC = P(None, "sp")


def _inputs(t, packed, seed=0):
    """q [1,t,2,16], k, v [1,t,1,16] (grouped queries), dout, positions and (packed) segment ids of three
    documents whose boundaries fall inside chunks, positions restarting in each."""
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((1, t, 2, 16), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, t, 1, 16), np.float32) for _ in range(2))
    pos, seg = np.arange(t, dtype=np.int32)[None], None
    if packed:
        cuts = [0, t // 3 - 20, t // 2 + 50, t]
        seg = np.concatenate([np.full(b - a, i + 1) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])[None]
        pos = np.concatenate([np.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None].astype(np.int32)
        seg = seg.astype(np.int32)
    return q, k, v, dout, pos, seg


def _ring(sp, order, causal, window, scores=()):
    mesh = jax.make_mesh((sp,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:sp])
    kw = dict(mesh=mesh, axis_name="sp", qkv_spec=SPEC, seq_spec=SPEC, kernel="splash", order=order,
              interpret=True, window=window, **dict(scores))  # fmt: skip
    return jax.jit(
        lambda q, k, v, dout, pos, seg: value_and_grads(ring_attention, q, k, v, dout, pos, seg, causal, **kw)
    )


@pytest.mark.parametrize(
    "sp, order, causal, window, packed",
    [
        (2, "contiguous", True, 0, False),
        (2, "zigzag", True, 0, True),
        (4, "contiguous", True, 100, False),  # a window shorter than a chunk of 128: steps 0 and 1 only
        (4, "contiguous", True, 200, True),  # longer than a chunk: three steps, each a LocalMask offset;
        # with a soft cap and a scale (Gemma 2's), also in the backward from the global residuals
        (2, "zigzag", False, 0, True),  # not causal: full chunks in any order
    ],
    ids=["contiguous", "zigzag_packed", "window_100", "window_200_packed", "full_packed"],
)
def test_splash_ring_equals_dense_attention(sp, order, causal, window, packed):
    chunk = 128
    t = sp * chunk * (2 if order == "zigzag" else 1)  # a zigzag shard holds two chunks
    q, k, v, dout, pos, seg = _inputs(t, packed)
    perm = zigzag_permutation(t, sp) if order == "zigzag" else np.arange(t)
    args = [x[:, perm] for x in (q, k, v, dout, pos)] + [None if seg is None else seg[:, perm]]
    scores = (("softcap", 2.0), ("scale", 0.3)) if window == 200 else ()
    got = _ring(sp, order, causal, window, scores)(*args)
    want = value_and_grads(dot_product_attention, *args, causal, window=window, **dict(scores))
    assert_all_close(got, want)


def test_fused_kernel_for_the_attention_choice():
    assert fused_kernel("splash", "tpu") == "splash"
    assert fused_kernel("auto", "tpu") is None  # auto keeps the ring the planner models
    assert fused_kernel("splash", "cpu", interpret=True) == "splash"
    for kernel, platform in (("auto", "gpu"), ("cudnn", "gpu"), ("triton", "gpu"), ("auto", "cpu"),
                             ("blockwise", "tpu"), ("dense", "tpu"), ("splash", "cpu")):  # fmt: skip
        assert fused_kernel(kernel, platform) is None, (kernel, platform)


def test_calls_the_fused_ring_cannot_serve_say_why():
    assert ring_fused.why_not("zigzag", True, 0, 256) is None
    assert ring_fused.why_not("contiguous", True, 100, 128) is None
    assert ring_fused.why_not(None, False, 0, 128) is None  # full attention: order does not matter
    assert "order" in ring_fused.why_not(None, True, 0, 128)
    assert "window" in ring_fused.why_not("zigzag", True, 100, 256)
    assert "window" in ring_fused.why_not("contiguous", False, 100, 128)
    assert "128" in ring_fused.why_not("zigzag", True, 0, 128)  # halves of 64
    assert "128" in ring_fused.why_not("contiguous", True, 0, 96)


def test_served_elsewhere_by_the_blockwise_ring(monkeypatch):
    """A call the fused ring cannot serve (no order given, or zigzag with a window) and the default kernel
    run the blockwise ring, exactly as before."""

    def refuse(*args, **kwargs):
        raise AssertionError("the fused ring ran")

    monkeypatch.setattr(ring_fused, "fused_ring_attention", refuse)
    q, k, v, dout, pos, _ = _inputs(256, packed=False)
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    kw = dict(mesh=mesh, axis_name="sp", qkv_spec=SPEC, seq_spec=SPEC, block_q=64, block_kv=64)
    want = dot_product_attention(q, k, v, q_positions=pos, kv_positions=pos)
    for extra in (dict(), dict(kernel="splash", interpret=True), dict(kernel="auto", order="contiguous")):
        got = jax.jit(functools.partial(ring_attention, q_positions=pos, kv_positions=pos, **kw, **extra))(q, k, v)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_fused_ring_on_tpu_has_no_conditional():
    """Forward + backward compiled ahead of time for 4 TPU v5p chips (sp = 4): splash calls, no conditional."""
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e .[tpu]): no TPU compile")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = jax.sharding.Mesh(np.array(devices), ("sp",))
    sharding = NamedSharding(mesh, SPEC)
    t = 4 * 256
    x, kv = (jax.ShapeDtypeStruct((1, t, n, 128), jnp.bfloat16, sharding=sharding) for n in (4, 2))
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=sharding)
    for order, window, calls in (("zigzag", 0, 2 * 7), ("contiguous", 300, 2 * 3)):

        def loss(q, k, v, pos, seg, order=order, window=window):
            out = ring_attention(
                q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, mesh=mesh,
                axis_name="sp", qkv_spec=SPEC, seq_spec=SPEC, kernel="splash", order=order, window=window,
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32))

        hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, kv, kv, seg, seg).compile().as_text()
        assert not re.search(r"\sconditional\(", hlo)  # the op, not a name in metadata
        # zigzag: 1 + 2 x 3 calls each way; a window of 300 over chunks of 256: steps 0-2 of 4.
        assert hlo.count("tpu_custom_call") == calls, order
