"""Paged attention equals the contiguous decode attention on the same keys and values: shuffled block
ids, rows of different lengths, grouped queries, window, soft cap and scale, one query or a chunk of
prefill, linear and ring tables; pages written then read back equal the contiguous cache; the TPU
wrapper's arguments give the same result through JAX's reference of the ragged kernel; the GPU
wrapper's (Pallas paged decode kernel) in interpret mode, and on a GPU where JAX has one
(`JAX_PLATFORMS=cuda pytest tests/ops/test_paged.py` on a GPU machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.ops.decode import decode_attention
from meshlm.ops.paged import (
    gather_pages,
    paged_attention_gpu,
    paged_decode_attention,
    ragged_kernel,
    ragged_paged_attention_tpu,
    table_positions,
    write_pages,
)

BLOCK, PAGES, D = 4, 24, 8


def random_tables(rng, rows: int, blocks_per_row: int) -> np.ndarray:
    """[rows, blocks_per_row] distinct block ids in shuffled order."""
    ids = rng.permutation(PAGES)[: rows * blocks_per_row]
    return ids.reshape(rows, blocks_per_row).astype(np.int32)


def table_slots(tables: np.ndarray, lengths, ring: bool = False) -> np.ndarray:
    """[B, max_len] flat slots of each row's positions 0..max_len-1 (-1 past its length; in a ring, -1
    too for the positions later ones overwrite)."""
    width = tables.shape[1] * BLOCK
    out = np.full((len(tables), max(lengths)), -1, np.int32)
    for row, n in enumerate(lengths):
        kept = np.arange(max(0, n - width), n) if ring else np.arange(n)
        logical = kept % width
        out[row, kept] = tables[row, logical // BLOCK] * BLOCK + logical % BLOCK
    return out


def fill(rng, tables, lengths, kvh, ring=False):
    """Random keys/values [B, max_len, K, D] per position, written into garbage pages through the tables."""
    b, n = len(lengths), max(lengths)
    k_seq, v_seq = (rng.standard_normal((b, n, kvh, D)).astype(np.float32) for _ in range(2))
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((PAGES, BLOCK, kvh, D)), jnp.float32) for _ in range(2))
    slots = table_slots(tables, lengths, ring).reshape(-1)
    k_pages, v_pages = write_pages(
        k_pages,
        v_pages,
        jnp.asarray(k_seq.reshape(b * n, kvh, D)),
        jnp.asarray(v_seq.reshape(b * n, kvh, D)),
        jnp.asarray(slots),
    )
    return k_seq, v_seq, k_pages, v_pages


def last_positions(lengths, t):
    return jnp.asarray(np.asarray(lengths)[:, None] - t + np.arange(t)[None, :], jnp.int32)


def contiguous(k_seq, v_seq, lengths):
    """The contiguous cache of the same tokens (slot s holds position s) and its positions."""
    n = k_seq.shape[1]
    kv_pos = np.where(np.arange(n)[None] < np.asarray(lengths)[:, None], np.arange(n)[None], -1)
    return jnp.asarray(k_seq), jnp.asarray(v_seq), jnp.asarray(kv_pos, jnp.int32)


CASES = [
    dict(t=1, h=4, kvh=2, kw={}),
    dict(t=1, h=4, kvh=4, kw=dict(window=5)),
    dict(t=3, h=4, kvh=2, kw={}),
    dict(t=3, h=8, kvh=2, kw=dict(window=6, softcap=2.0, scale=0.3)),
]


@pytest.mark.parametrize("case", CASES, ids=["decode-gqa", "decode-window", "chunk-gqa", "chunk-all"])
def test_paged_equals_contiguous_decode(case):
    rng = np.random.default_rng(0)
    t, h, kvh, kw = case["t"], case["h"], case["kvh"], case["kw"]
    lengths = [5, 16, 11]
    tables = random_tables(rng, len(lengths), 5)  # 20 slots per row; rows past their length pad
    k_seq, v_seq, k_pages, v_pages = fill(rng, tables, lengths, kvh)
    q = jnp.asarray(rng.standard_normal((len(lengths), t, h, D)), jnp.float32)
    q_pos = last_positions(lengths, t)
    got = paged_decode_attention(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths), q_pos, **kw)
    want = decode_attention(
        q, *contiguous(k_seq, v_seq, lengths)[:2], q_pos, contiguous(k_seq, v_seq, lengths)[2], **kw
    )
    np.testing.assert_allclose(got, want, atol=1e-5)
    other = kw | dict(window=2) if kw.get("window") else kw | dict(softcap=1.0)
    moved = paged_decode_attention(q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths), q_pos, **other)
    assert not np.allclose(moved, got, atol=1e-3)  # the options reach the masking


@pytest.mark.parametrize("t", [1, 2])
def test_a_ring_table_equals_the_window_over_the_whole_history(t):
    """A sliding-window layer's ring of ceil(W/block)+1 blocks: position p in logical slot p mod 12.
    Its attention equals windowed attention over the whole history laid out contiguously."""
    rng = np.random.default_rng(1)
    window, h, kvh = 6, 4, 2
    lengths = [3, 13, 30]
    tables = random_tables(rng, len(lengths), 3)
    k_seq, v_seq, k_pages, v_pages = fill(rng, tables, lengths, kvh, ring=True)
    q = jnp.asarray(rng.standard_normal((len(lengths), t, h, D)), jnp.float32)
    q_pos = last_positions(lengths, t)
    got = paged_decode_attention(
        q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths), q_pos, window=window, ring=True
    )
    k, v, kv_pos = contiguous(k_seq, v_seq, lengths)
    np.testing.assert_allclose(got, decode_attention(q, k, v, q_pos, kv_pos, window=window), atol=1e-5)


def test_table_positions_follow_the_ring():
    held = np.asarray(table_positions(jnp.asarray([3, 14]), 8, ring=True))
    assert held[0].tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    assert held[1].tolist() == [8, 9, 10, 11, 12, 13, 6, 7]  # newest 13 in slot 13 mod 8 = 5
    assert np.asarray(table_positions(jnp.asarray([3]), 5))[0].tolist() == [0, 1, 2, -1, -1]


def test_written_pages_read_back_as_the_contiguous_cache():
    rng = np.random.default_rng(2)
    lengths, kvh = [7, 12], 2
    tables = random_tables(rng, 2, 3)
    k_seq, v_seq, k_pages, v_pages = fill(rng, tables, lengths, kvh)
    for pages, seq in ((k_pages, k_seq), (v_pages, v_seq)):
        back = np.asarray(gather_pages(pages, jnp.asarray(tables)))
        for row, n in enumerate(lengths):
            np.testing.assert_array_equal(back[row, :n], seq[row, :n])
    untouched = np.setdiff1d(np.arange(PAGES), tables)
    skipped, _ = write_pages(k_pages, v_pages, jnp.ones((2, kvh, D)), jnp.ones((2, kvh, D)), jnp.asarray([-1, -1]))
    np.testing.assert_array_equal(skipped, k_pages)  # -1 writes nothing
    assert untouched.size  # pages outside the tables kept their contents above


@pytest.mark.parametrize("t, kw", [(1, {}), (3, dict(window=5, softcap=3.0, scale=0.2))], ids=["decode", "chunk"])
def test_tpu_wrapper_arguments_give_the_same_result_through_the_kernel_reference(t, kw):
    """The wrapper's layout (combined K/V pages, ragged queries, lengths) through JAX's pure-JAX
    reference of the ragged kernel equals the paged reference."""
    kernel_module = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    assert ragged_kernel() is kernel_module.ragged_paged_attention
    rng = np.random.default_rng(3)
    lengths, h, kvh = [6, 17, 9], 4, 2
    tables = random_tables(rng, len(lengths), 5)
    _, _, k_pages, v_pages = fill(rng, tables, lengths, kvh)
    q = jnp.asarray(rng.standard_normal((len(lengths), t, h, D)), jnp.float32)
    args = (q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))
    got = ragged_paged_attention_tpu(*args, kernel=kernel_module.ref_ragged_paged_attention, **kw)
    want = paged_decode_attention(*args, last_positions(lengths, t), **kw)
    np.testing.assert_allclose(got, want, atol=1e-5)


def gpu_case(rng, lengths, h, kvh, d, dtype):
    """A decode step's query [B, 1, H, d] and pages of `dtype` filled through shuffled tables of 4 blocks."""
    tables = random_tables(rng, len(lengths), 4)
    pages = [jnp.asarray(rng.standard_normal((PAGES, BLOCK, kvh, d)), dtype) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((len(lengths), 1, h, d)), dtype)
    return q, *pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("kw", [{}, dict(softcap=2.0, scale=0.3)], ids=["plain", "softcap-scale"])
def test_gpu_wrapper_in_interpret_mode_equals_the_reference(kw):
    args = gpu_case(np.random.default_rng(4), [5, 16, 9], 4, 2, 16, jnp.float32)
    got = paged_attention_gpu(*args, interpret=True, **kw)
    want = paged_decode_attention(*args, last_positions([5, 16, 9], 1), **kw)
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(NotImplementedError, match="one query per row"):
        paged_attention_gpu(jnp.concatenate([args[0]] * 2, axis=1), *args[1:], interpret=True)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (JAX's default backend here is not gpu)")
def test_gpu_wrapper_on_a_gpu_equals_the_reference():
    """bfloat16 pages at a GPU-sized head (8 query / 2 kv heads of 128) against the float32 reference."""
    lengths = [5, 16, 9, 1]
    args = gpu_case(np.random.default_rng(5), lengths, 8, 2, 128, jnp.bfloat16)
    got = jax.jit(paged_attention_gpu)(*args)
    want = paged_decode_attention(*(a.astype(jnp.float32) if i < 3 else a for i, a in enumerate(args)),
                                  last_positions(lengths, 1))  # fmt: skip
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2)
