"""Blockwise (flash) attention against the plain reference: values, gradients, masking, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.ops.attention import blockwise_attention, dot_product_attention
from meshlm.ops.attention_masks import attention_mask as attn_mask
from meshlm.ops.attention_masks import block_may_attend, block_table, key_block_lists
from tests.support.attention import ATOL, assert_all_close, make_inputs, reference, value_and_grads


@pytest.mark.parametrize("kvh", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "segments"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_blockwise_matches_reference(causal, packed, kvh):
    q, k, v, dout, pos, seg = make_inputs(0, kvh=kvh, packed=packed)
    blockwise = jax.jit(
        lambda q, k, v, dout, pos, seg: value_and_grads(
            blockwise_attention, q, k, v, dout, pos, seg, causal, block_q=32, block_kv=16
        )
    )
    got = blockwise(q, k, v, dout, pos, seg)
    want = reference(q, k, v, dout, pos, seg, causal=causal)
    assert got[0].shape == q.shape and got[0].dtype == q.dtype
    assert_all_close(got, want)
    if packed:  # padding rows attend nothing: zero output, zero gradient
        assert not np.any(np.asarray(got[0])[:, -8:]) and not np.any(np.asarray(got[1])[:, -8:])


def test_reference_decode_against_a_kv_cache():
    """One new token against a cache whose unused slots have position -1."""
    rng = np.random.default_rng(1)
    b, s, h, kvh, d = 2, 16, 4, 2, 8
    q = rng.standard_normal((b, 1, h, d), np.float32)
    k = rng.standard_normal((b, s, kvh, d), np.float32)
    v = rng.standard_normal((b, s, kvh, d), np.float32)
    filled = np.array([5, 11])  # cache slots in use per row; the new token is at position filled-1
    kv_pos = np.where(np.arange(s)[None] < filled[:, None], np.arange(s)[None], -1).astype(np.int32)
    q_pos = (filled - 1)[:, None].astype(np.int32)
    out = dot_product_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos)
    for row in range(b):
        n = filled[row]
        for head in range(h):
            kv = head // (h // kvh)
            scores = k[row, :n, kv] @ q[row, 0, head] / np.sqrt(d)
            p = np.exp(scores - scores.max())
            want = (p / p.sum()) @ v[row, :n, kv]
            np.testing.assert_allclose(out[row, 0, head], want, atol=1e-5)


def test_blockwise_bf16_keeps_dtype_and_is_close():
    q, k, v, dout, pos, _ = make_inputs(2, t=64)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    attend = functools.partial(blockwise_attention, block_q=16, block_kv=16)
    out = jax.jit(attend)(*bf16, q_positions=pos, kv_positions=pos)
    want = jax.jit(dot_product_attention)(q, k, v, q_positions=pos, kv_positions=pos)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=3e-2)


def test_block_sizes_are_clamped_and_checked():
    q, k, v, _, pos, _ = make_inputs(3, t=48)
    kw = dict(q_positions=pos, kv_positions=pos)
    want = jax.jit(dot_product_attention)(q, k, v, **kw)
    got = jax.jit(blockwise_attention)(q, k, v, **kw)  # blocks of 512 clamped to 48
    np.testing.assert_allclose(got, want, atol=ATOL)
    with pytest.raises(ValueError, match="divisible"):
        blockwise_attention(q, k, v, **kw, block_q=32)
    with pytest.raises(ValueError, match="multiple"):
        blockwise_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), **kw)
    with pytest.raises(ValueError, match="both"):
        blockwise_attention(q, k, v, **kw, q_segment_ids=pos)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "segments"])
def test_one_block_runs_without_conditionals(packed):
    """A single (query block, key block) pair is computed with no `lax.cond` (several pairs keep theirs),
    and gives the reference's values and gradients, padding rows (nothing to attend) included."""
    q, k, v, dout, pos, seg = make_inputs(1, t=64, packed=packed)

    def run(block):
        return value_and_grads(blockwise_attention, q, k, v, dout, pos, seg, True, block_q=block, block_kv=block)

    def conds(block):
        return str(jax.make_jaxpr(lambda: run(block))()).count("cond[")

    assert conds(64) == 0 and conds(32) > 0
    assert_all_close(jax.jit(lambda: run(64))(), reference(q, k, v, dout, pos, seg, causal=True))


def test_block_skipping_decision():
    """block_may_attend is False exactly for blocks the mask rules out entirely."""
    pos = lambda lo, hi: jnp.arange(lo, hi, dtype=jnp.int32)[None]  # noqa: E731
    seg = lambda i, n: jnp.full((1, n), i, jnp.int32)  # noqa: E731
    assert block_may_attend(pos(16, 32), pos(0, 16), None, None, causal=True)
    assert block_may_attend(pos(8, 24), pos(16, 32), None, None, causal=True)  # straddles diagonal
    assert not block_may_attend(pos(0, 16), pos(16, 32), None, None, causal=True)  # above it
    assert block_may_attend(pos(0, 16), pos(16, 32), None, None, causal=False)
    assert not block_may_attend(pos(0, 16), jnp.full((1, 16), -1), None, None, causal=False)
    assert not block_may_attend(pos(0, 16), pos(0, 16), seg(1, 16), seg(2, 16), causal=False)
    # Batch rows share one decision: computed if any row needs it.
    two_rows_q = jnp.concatenate([pos(0, 16), pos(32, 48)])
    assert block_may_attend(two_rows_q, jnp.concatenate([pos(16, 32)] * 2), None, None, causal=True)


def _fwd_bwd_bytes(fn, t, **kw):
    """Per-device bytes (arguments + outputs + temporaries) of a compiled forward + backward."""
    b, h, d = 1, 4, 16
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
    pos = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, pos, dout):
        return jnp.sum(fn(q, k, v, q_positions=pos, kv_positions=pos, **kw) * dout)

    stats = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x, pos, x).compile().memory_analysis()
    return (
        stats.argument_size_in_bytes + stats.output_size_in_bytes
        + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )  # fmt: skip


def test_blockwise_memory_grows_linearly_in_length():
    small, big = 4096, 16384  # 4x longer
    blockwise = [_fwd_bwd_bytes(blockwise_attention, t, block_q=256, block_kv=256) for t in (small, big)]
    assert blockwise[1] / blockwise[0] < 4.5, blockwise  # linear: 4x; quadratic would be 16x
    dense = [_fwd_bwd_bytes(dot_product_attention, t) for t in (small, big)]
    assert dense[1] / dense[0] > 10, dense  # the reference really is quadratic: the check can fail
    assert blockwise[1] < dense[1] / 20


# --------------------------------------------------------------------------------------------
# Sliding-window (local) attention, soft-capping and a custom scale
# --------------------------------------------------------------------------------------------


def test_window_mask_against_numpy():
    """A query at position p sees exactly the keys at p-W+1 .. p (transformers' sliding window:
    kv_idx > q_idx - W), for shuffled positions, empty slots and without the causal mask."""
    rng = np.random.default_rng(0)
    q_pos = rng.permutation(40)[None].astype(np.int32)
    kv_pos = np.where(rng.random(40) < 0.2, -1, rng.permutation(40))[None].astype(np.int32)
    for causal, window in [(True, 1), (True, 7), (False, 7), (True, 0)]:
        got = np.asarray(attn_mask(q_pos, kv_pos, None, None, causal, window))[0]
        want = np.zeros_like(got)
        for i, p in enumerate(q_pos[0]):
            for j, kp in enumerate(kv_pos[0]):
                seen = range(p - window + 1, p + 1) if causal and window else None
                if kp < 0:
                    continue
                if seen is not None:
                    want[i, j] = kp in seen
                else:
                    want[i, j] = (kp <= p or not causal) and (not window or p - kp < window)
        np.testing.assert_array_equal(got, want, err_msg=f"causal={causal} window={window}")


def test_dense_window_softcap_scale_against_numpy():
    """The reference itself: softmax over the window of softcap * tanh(scale * q.k / softcap)."""
    q, k, v, _, pos, _ = make_inputs(4, b=1, t=24, h=2, kvh=1, d=8)
    window, softcap, scale = 5, 2.0, 0.7
    out = dot_product_attention(q, k, v, q_positions=pos, kv_positions=pos, window=window, softcap=softcap, scale=scale)
    for head in range(2):
        scores = softcap * np.tanh(scale * q[0, :, head] @ k[0, :, 0].T / softcap)
        p_q, p_k = pos[0][:, None], pos[0][None, :]
        scores = np.where((p_k <= p_q) & (p_q - p_k < window), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ v[0, :, 0]
        np.testing.assert_allclose(out[0, :, head], want, atol=1e-5)


@pytest.mark.parametrize(
    "packed, causal, kw",
    [
        (False, True, dict(window=10)),  # shorter than a key block
        (True, True, dict(window=40, softcap=3.0)),  # longer than a block, documents, soft cap
        (False, True, dict(softcap=1.5, scale=0.4)),  # global, soft cap and a custom scale
        (False, False, dict(window=24)),  # not causal: every key ahead, and 23 behind
    ],
    ids=["window_short", "window_long_softcap_packed", "softcap_scale", "window_not_causal"],
)
def test_blockwise_window_softcap_scale_match_reference(packed, causal, kw):
    """Values and gradients (the hand-written backward: d softcap * tanh(s / softcap) / ds = 1 - tanh^2)."""
    q, k, v, dout, pos, seg = make_inputs(5, packed=packed)
    got = jax.jit(lambda *a: value_and_grads(blockwise_attention, *a, causal, block_q=32, block_kv=16, **kw))(
        q, k, v, dout, pos, seg
    )
    want = jax.jit(lambda *a: value_and_grads(dot_product_attention, *a, causal, **kw))(q, k, v, dout, pos, seg)
    assert_all_close(got, want)


def test_window_visits_only_the_blocks_it_needs():
    """At T = 1024 in blocks of 64 with a window of 128, each query block visits at most 3 key blocks
    (its own and the 2 behind), never the 16 a pass over the row would: O(T * W) work."""
    pos = jnp.arange(1024, dtype=jnp.int32)[None]
    table = block_table(pos, pos, None, None, True, 128, 64, 64)
    order, count = key_block_lists(table)
    np.testing.assert_array_equal(count, np.minimum(np.arange(16) + 1, 3))
    np.testing.assert_array_equal(order[10, :3], [8, 9, 10])
    assert not block_may_attend(pos[:, 512:576], pos[:, :64], None, None, causal=True, window=128)
    # The nearest pair is query 512, key 383: 129 apart.
    assert block_may_attend(pos[:, 512:576], pos[:, 320:384], None, None, causal=True, window=130)
    assert not block_may_attend(pos[:, 512:576], pos[:, 320:384], None, None, causal=True, window=129)
