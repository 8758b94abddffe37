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
    copy_blocks,
    gather_pages,
    paged_attention_gpu,
    paged_decode_attention,
    ragged_kernel,
    ragged_paged_attention_tpu,
    table_positions,
    write_pages,
)
from meshlm.serve.engine.blocks import BlockPool, SequenceBlocks, ring_blocks_for_window

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


jit_write = jax.jit(write_pages)
jit_copy = jax.jit(copy_blocks)
jit_attend = jax.jit(paged_decode_attention, static_argnames=("window", "softcap", "scale", "ring"))


class Stepper:
    """Sequences of a block pool advanced step by step as the engine would: grow the table, run the
    grant's copies, write the new tokens' keys and values at the table's slots."""

    def __init__(self, rng, kvh):
        self.rng, self.kvh = rng, kvh
        self.pool = BlockPool(PAGES, BLOCK)
        self.k_pages, self.v_pages = (
            jnp.asarray(rng.standard_normal((PAGES, BLOCK, kvh, D)), jnp.float32) for _ in range(2)
        )
        self.history = {}  # id(seq) -> (keys, values) of every position so far

    def step(self, seq, n):
        start = seq.num_tokens
        grant = seq.append_tokens(n)
        assert grant is not None
        if grant.copies:
            self.k_pages, self.v_pages = jit_copy(self.k_pages, self.v_pages, jnp.asarray(grant.copies, jnp.int32))
        k, v = (self.rng.standard_normal((n, self.kvh, D)).astype(np.float32) for _ in range(2))
        slots = jnp.asarray(seq.slots(start, n))
        self.k_pages, self.v_pages = jit_write(self.k_pages, self.v_pages, jnp.asarray(k), jnp.asarray(v), slots)
        old_k, old_v = self.history.get(id(seq), (np.zeros((0, self.kvh, D), np.float32),) * 2)
        self.history[id(seq)] = (np.concatenate([old_k, k]), np.concatenate([old_v, v]))

    def check(self, seqs, width, h=4, **kw):
        """Each sequence's newest query against its pages equals the contiguous reference over its history."""
        lengths = [s.num_tokens for s in seqs]
        q = jnp.asarray(self.rng.standard_normal((len(seqs), 1, h, D)), jnp.float32)
        tables = jnp.asarray(np.stack([s.padded_table(width) for s in seqs]))
        q_pos = last_positions(lengths, 1)
        got = jit_attend(q, self.k_pages, self.v_pages, tables, jnp.asarray(lengths), q_pos, **kw)
        n = max(lengths)
        pad = [
            np.pad(np.stack(self.history[id(s)][i]), ((0, n - s.num_tokens), (0, 0), (0, 0)))
            for s in seqs
            for i in (0, 1)
        ]
        k, v, kv_pos = contiguous(np.stack(pad[0::2]), np.stack(pad[1::2]), lengths)
        kw.pop("ring", None)
        np.testing.assert_allclose(got, decode_attention(q, k, v, q_pos, kv_pos, **kw), atol=1e-5)


def test_forked_sequences_step_through_their_tables():
    """A prompt of 7 tokens, forked (the partial block copied), then each sample decodes its own tokens:
    each attends the shared prompt and only its own continuation."""
    stepper = Stepper(np.random.default_rng(6), kvh=2)
    parent = SequenceBlocks(stepper.pool)
    stepper.step(parent, 7)
    child, copies = parent.fork()
    stepper.k_pages, stepper.v_pages = jit_copy(stepper.k_pages, stepper.v_pages, jnp.asarray(copies, jnp.int32))
    stepper.history[id(child)] = stepper.history[id(parent)]
    for _ in range(6):
        for seq in (parent, child):
            stepper.step(seq, 1)
        stepper.check([parent, child], width=4)
    assert parent.table[0] == child.table[0] and parent.table[-1] != child.table[-1]


def test_a_ring_sequence_steps_through_its_table():
    """A sliding-window layer's ring (W = 6: 3 blocks of 4), forked mid-way: one token per step, each
    step's query equals windowed attention over the whole history."""
    stepper = Stepper(np.random.default_rng(7), kvh=2)
    ring = ring_blocks_for_window(6, BLOCK)
    seq = SequenceBlocks(stepper.pool, ring_blocks=ring)
    stepper.step(seq, 5)
    for _ in range(9):
        stepper.step(seq, 1)
    child, _ = seq.fork()
    stepper.history[id(child)] = stepper.history[id(seq)]
    for _ in range(8):
        for s in (seq, child):
            stepper.step(s, 1)
        stepper.check([seq, child], width=ring, window=6, ring=True)
    assert len(seq.table) == ring and not set(seq.table) & set(child.table)  # every shared block was copied
