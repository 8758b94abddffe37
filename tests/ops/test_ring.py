"""RingAttention on 8 simulated devices: exactness against full attention, load balance, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.ops.attention import dot_product_attention
from meshlm.ops.attention_masks import block_may_attend, block_table
from meshlm.ops.ring import (
    inverse_permutation,
    ring_attention,
    ring_block_size,
    zigzag_permutation,
)
from tests.support.attention import assert_all_close, make_inputs, reference, value_and_grads

AXES = ("dp", "fsdp", "tp", "sp")
QKV_SPEC = P(("dp", "fsdp"), "sp", "tp", None)
SEQ_SPEC = P(("dp", "fsdp"), "sp")


@functools.cache
def make_mesh(shape):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 4, devices=jax.devices()[:n])


@functools.cache
def ring_fn(mesh_shape, causal, block):
    """A jitted ring forward + backward; cached so that cases differing only in data share it."""
    kw = dict(
        mesh=make_mesh(mesh_shape), axis_name="sp", qkv_spec=QKV_SPEC, seq_spec=SEQ_SPEC,
        block_q=block, block_kv=block,
    )  # fmt: skip
    return jax.jit(
        lambda q, k, v, dout, pos, seg: value_and_grads(ring_attention, q, k, v, dout, pos, seg, causal, **kw)
    )


def check_ring(mesh_shape, *, causal, packed, kvh, block=16, orders=("contiguous", "zigzag")):
    """Ring == full attention (values and dq, dk, dv) for each token order, on the same compile."""
    sp = mesh_shape[-1]
    q, k, v, dout, pos, seg = make_inputs(sp, t=128, kvh=kvh, packed=packed)
    for order in orders:
        perm = zigzag_permutation(128, sp) if order == "zigzag" else np.arange(128)
        args = [x[:, perm] for x in (q, k, v, dout, pos)] + [None if seg is None else seg[:, perm]]
        got = ring_fn(mesh_shape, causal, block)(*args)
        want = reference(*args, causal=causal)
        assert_all_close(got, want)
        # Undoing the permutation gives full attention on the original order.
        inv = inverse_permutation(perm)
        want_unpermuted = reference(q, k, v, dout, pos, seg, causal=causal)
        np.testing.assert_allclose(np.asarray(got[0])[:, inv], want_unpermuted[0], atol=1e-5)


@pytest.mark.parametrize("kvh", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "segments"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("sp", [1, 2, 4, 8])
def test_ring_matches_full_attention(sp, causal, packed, kvh):
    # Local shards of 128/sp tokens in blocks of <= 16: several blocks per shard, so skipping is
    # exercised. Non-causal attention does not depend on token order: one order suffices.
    orders = ("contiguous", "zigzag") if causal else ("zigzag",)
    check_ring((1, 1, 1, sp), causal=causal, packed=packed, kvh=kvh, orders=orders)


@pytest.mark.parametrize("mesh_shape", [(1, 2, 2, 2), (2, 1, 1, 4)], ids=["1,2,2,2", "2,1,1,4"])
def test_ring_composes_with_batch_and_head_sharding(mesh_shape):
    """Batch over (dp, fsdp), kv heads over tp and length over sp, all at once."""
    check_ring(mesh_shape, causal=True, packed=True, kvh=2)


def test_ring_lowers_to_collective_permutes_only():
    """K/V move by collective-permute; nothing is all-gathered (no hidden full-sequence copy)."""
    q, k, v, dout, pos, seg = make_inputs(0, t=128, kvh=2, packed=True)
    hlo = ring_fn((1, 2, 2, 2), True, 16).lower(q, k, v, dout, pos, seg).compile().as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_zigzag_permutation():
    perm = zigzag_permutation(16, 2)
    np.testing.assert_array_equal(perm, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    for sp in (1, 2, 4, 8):
        perm = zigzag_permutation(64, sp)
        assert sorted(perm) == list(range(64))
        chunks = perm.reshape(2 * sp, -1)[:, 0] // (64 // (2 * sp))  # chunk id of each half-shard
        np.testing.assert_array_equal(chunks.reshape(sp, 2), [[r, 2 * sp - 1 - r] for r in range(sp)])
        x = np.arange(64) * 10
        np.testing.assert_array_equal(x[perm][inverse_permutation(perm)], x)
    with pytest.raises(ValueError, match="divisible"):
        zigzag_permutation(20, 4)


def blocks_computed(positions, sp, block):
    """[sp ranks, sp steps] number of (query block, key block) pairs the ring computes (causal)."""
    shards = positions.reshape(sp, -1)
    work = np.zeros((sp, sp), int)
    for rank in range(sp):
        for step in range(sp):
            q_blocks = shards[rank].reshape(-1, block)
            kv_blocks = shards[(rank - step) % sp].reshape(-1, block)
            work[rank, step] = sum(
                bool(block_may_attend(qb[None], kb[None], None, None, causal=True))
                for qb in q_blocks
                for kb in kv_blocks
            )
    return work


def test_zigzag_balances_causal_work_and_skips_masked_blocks():
    t, sp = 64, 4
    block = ring_block_size(512, t // sp, causal=True)
    assert block == t // sp // 2  # a zigzag shard splits into its two chunks
    balanced = blocks_computed(zigzag_permutation(t, sp), sp, block)
    contiguous = blocks_computed(np.arange(t), sp, block)
    # Every rank does the same work at every step: 3 of 4 blocks on the diagonal, 2 of 4 after.
    np.testing.assert_array_equal(balanced[:, 0], 3)
    np.testing.assert_array_equal(balanced[:, 1:], 2)
    assert balanced.sum() == contiguous.sum()  # the same total, skipped blocks included
    # Steps run in lockstep, so time follows the busiest rank of each step.
    assert contiguous.max(axis=0).sum() / balanced.max(axis=0).sum() > 1.5


def ring_bytes(sp, t, h, kvh, d, block):
    """Per-device bytes (arguments + outputs + temporaries) of a compiled ring forward + backward."""
    mesh = make_mesh((1, 1, 1, sp))
    qkv_sharding, seq_sharding = NamedSharding(mesh, QKV_SPEC), NamedSharding(mesh, SEQ_SPEC)
    x, kv = (jax.ShapeDtypeStruct((1, t, n, d), jnp.float32, sharding=qkv_sharding) for n in (h, kvh))
    pos = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=seq_sharding)
    kw = dict(mesh=mesh, axis_name="sp", qkv_spec=QKV_SPEC, seq_spec=SEQ_SPEC)
    kw.update(block_q=block, block_kv=block)

    def loss(q, k, v, pos, dout):
        return jnp.sum(ring_attention(q, k, v, q_positions=pos, kv_positions=pos, **kw) * dout)

    stats = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, kv, kv, pos, x).compile().memory_analysis()
    return (
        stats.argument_size_in_bytes + stats.output_size_in_bytes
        + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )  # fmt: skip


def test_ring_memory_per_device_shrinks_with_sp():
    """At a long length, sp=4 needs at most 0.35x the per-device memory of sp=1.

    Grouped-query heads (8 query heads, 2 kv heads, as in LLaMA-3): with as many kv heads as
    query heads the ring's double-buffered K, V, dK, dV weigh more and the ratio was about 0.42.
    """
    t = 32768  # compile only: nothing of this size is allocated
    one, four = (ring_bytes(sp, t, h=8, kvh=2, d=16, block=128) for sp in (1, 4))
    assert four <= 0.35 * one, (four, one, four / one)


def test_ring_rejects_specs_that_do_not_shard_length_over_the_axis():
    q, k, v, _, pos, _ = make_inputs(0, t=32)
    with pytest.raises(ValueError, match="length"):
        ring_attention(
            q, k, v, q_positions=pos, kv_positions=pos, mesh=make_mesh((1, 1, 1, 4)),
            axis_name="sp", qkv_spec=P(None, None, "sp", None), seq_spec=SEQ_SPEC,
        )  # fmt: skip


@functools.cache
def local_ring_fn(sp, window, softcap, scale):
    """A jitted ring forward + backward with a sliding window, soft cap and scale, on (1, 1, 1, sp)."""
    kw = dict(mesh=make_mesh((1, 1, 1, sp)), axis_name="sp", qkv_spec=QKV_SPEC, seq_spec=SEQ_SPEC, block_q=16)
    kw.update(block_kv=16, window=window, softcap=softcap, scale=scale)
    return jax.jit(lambda q, k, v, dout, pos, seg: value_and_grads(ring_attention, q, k, v, dout, pos, seg, True, **kw))


@pytest.mark.parametrize(
    "window, softcap, scale, packed",
    [(10, 0.0, None, False), (50, 2.0, 0.3, True)],
    ids=["window_under_a_chunk", "window_over_a_chunk_softcap_packed"],
)
def test_ring_local_attention_matches_full_attention(window, softcap, scale, packed):
    """sp=4, shards of 32 tokens (zigzag halves of 16): windows shorter and longer than a chunk, with a
    soft cap and a custom scale; values and dq, dk, dv against the dense reference, in both orders."""
    sp, t = 4, 128
    q, k, v, dout, pos, seg = make_inputs(7, t=t, kvh=2, packed=packed)
    kw = dict(window=window, softcap=softcap, scale=scale)
    want_fn = jax.jit(lambda *a: value_and_grads(dot_product_attention, *a, True, **kw))
    for perm in (np.arange(t), zigzag_permutation(t, sp)):
        args = [x[:, perm] for x in (q, k, v, dout, pos)] + [None if seg is None else seg[:, perm]]
        assert_all_close(local_ring_fn(sp, *kw.values())(*args), want_fn(*args))


def steps_computed(positions, sp, block, window):
    """[sp ranks, sp steps] bool: whether the ring's step computes at all (some block pair may attend)."""
    shards = jnp.asarray(positions.reshape(sp, 1, -1))
    return np.array([
        [bool(jnp.any(block_table(shards[r], shards[(r - i) % sp], None, None, True, window, block, block)))
         for i in range(sp)]
        for r in range(sp)
    ])  # fmt: skip


def test_ring_steps_outside_the_window_are_skipped():
    """A window shorter than a shard needs only the shard itself and its neighbour; in zigzag order a
    rank's two halves are judged apart, so the late half does not make every step look needed."""
    t, sp, window = 256, 4, 20
    contiguous = steps_computed(np.arange(t), sp, 32, window)
    np.testing.assert_array_equal(contiguous[:, 2:], False)  # steps 2 and 3: nothing within the window
    np.testing.assert_array_equal(contiguous[1:, :2], True)
    zigzag = steps_computed(zigzag_permutation(t, sp), sp, 32, window)
    # Each half needs its own chunk and the one before it: at most 3 of 4 steps, and step 2 nowhere.
    assert np.all(zigzag.sum(axis=1) <= 3) and not zigzag[:, 2].any(), zigzag
    assert steps_computed(np.arange(t), sp, 32, 0).sum() == sp * (sp + 1) // 2  # global causal: all below
