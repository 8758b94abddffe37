"""The paged KV cache's host side: reference counts, exhaustion, fork and copy-on-write, prefix reuse,
LRU eviction, ring tables and the memory budget's arithmetic."""

import numpy as np
import pytest

from meshlm.errors import UsageError
from meshlm.serve.engine.blocks import (
    BlockPool,
    SequenceBlocks,
    block_key,
    blocks_for_budget,
    ring_blocks_for_window,
)


def check_pool(pool: BlockPool, sequences=()) -> None:
    """No block both free (or evictable) and held; each held block's count is the number of tables
    holding it; every block is in exactly one state."""
    free, evictable = set(pool.free_blocks()), set(pool.evictable_blocks())
    holders = np.zeros(pool.num_blocks, np.int32)
    for seq in sequences:
        for b in seq.table:
            holders[b] += 1
    held = set(np.flatnonzero(pool.ref_counts > 0).tolist())
    assert not free & held and not evictable & held and not free & evictable
    assert free | evictable | held == set(range(pool.num_blocks))
    assert (pool.ref_counts >= 0).all()
    if sequences:
        np.testing.assert_array_equal(pool.ref_counts, holders)


def test_allocate_and_free_keep_the_counts():
    pool = BlockPool(6, 4)
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.num_free == 2
    assert (pool.ref_counts[a] == 1).all()
    pool.share(a[:2])
    assert (pool.ref_counts[a[:2]] == 2).all()
    pool.free(a)
    assert pool.num_free == 4 and (pool.ref_counts[a[:2]] == 1).all()
    check_pool(pool)
    pool.free(a[:2])
    assert pool.num_free == 6
    with pytest.raises(ValueError, match="not held"):
        pool.free(a[:1])


def test_exhaustion_returns_none_and_takes_nothing():
    pool = BlockPool(3, 4)
    seq = SequenceBlocks(pool)
    assert seq.append_tokens(9) is not None and len(seq.table) == 3
    assert pool.num_free == 0
    assert seq.blocks_needed(4) == 1
    assert seq.append_tokens(4) is None  # needs a 4th block
    assert seq.num_tokens == 9 and len(seq.table) == 3
    assert seq.append_tokens(3) is not None  # fills the third block: no new block
    other = SequenceBlocks(pool)
    assert other.append_tokens(1) is None and other.table == []
    check_pool(pool, [seq, other])
    seq.release()
    assert pool.num_free == 3
    check_pool(pool, [seq, other])


def test_growth_one_block_at_a_time():
    pool = BlockPool(8, 4)
    seq = SequenceBlocks(pool)
    grants = [seq.append_tokens(1) for _ in range(9)]
    assert [len(g.blocks) for g in grants] == [1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert len(seq.table) == 3 and seq.num_tokens == 9
    slots = seq.slots(0, 9)
    assert slots.tolist() == [seq.table[p // 4] * 4 + p % 4 for p in range(9)]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    pool = BlockPool(8, 4)
    parent = SequenceBlocks(pool)
    parent.append_tokens(10)  # blocks 0, 1 full, block 2 holds 2 tokens
    child, copies = parent.fork()
    assert child.table[:2] == parent.table[:2] and child.table[2] != parent.table[2]
    assert copies == [(parent.table[2], child.table[2])]
    assert (pool.ref_counts[parent.table[:2]] == 2).all()
    assert pool.ref_counts[parent.table[2]] == 1 and pool.ref_counts[child.table[2]] == 1
    check_pool(pool, [parent, child])
    grant = child.append_tokens(2)  # writes into its own copy only
    assert grant.blocks == [] and grant.copies == []
    child.release()
    assert (pool.ref_counts[parent.table] == 1).all()
    check_pool(pool, [parent, child])


def test_fork_of_full_blocks_copies_nothing_until_a_new_block():
    pool = BlockPool(8, 4)
    parent = SequenceBlocks(pool)
    parent.append_tokens(8)
    child, copies = parent.fork()
    assert copies == [] and child.table == parent.table
    grant = child.append_tokens(1)
    assert len(grant.blocks) == 1 and grant.copies == [] and grant.blocks[0] not in parent.table
    check_pool(pool, [parent, child])


def test_fork_without_room_for_the_copy_raises_and_holds_nothing_more():
    pool = BlockPool(2, 4)
    parent = SequenceBlocks(pool)
    parent.append_tokens(6)
    with pytest.raises(MemoryError):
        parent.fork()
    check_pool(pool, [parent])


def test_a_ring_table_stops_growing_and_copies_shared_blocks_it_writes():
    pool = BlockPool(8, 4)
    window = 5
    ring = ring_blocks_for_window(window, 4)
    assert ring == 3
    seq = SequenceBlocks(pool, ring_blocks=ring)
    for _ in range(20):
        assert seq.append_tokens(1) is not None
    assert len(seq.table) == 3 and pool.num_free == 5
    assert seq.slots(12, 1).tolist() == [seq.table[0] * 4]  # position 12 wraps to logical slot 0
    child, copies = seq.fork()
    assert copies == [] and child.table == seq.table
    grant = child.append_tokens(1)  # position 20 lands in logical slot 8: block 2, shared
    assert grant.copies == [(seq.table[2], child.table[2])] and grant.blocks == []
    check_pool(pool, [seq, child])


def prompt(*blocks, size=4):
    """Token ids: each argument fills one block of `size` with its value (plus one trailing token)."""
    return [b for b in blocks for _ in range(size)] + [99]


def admit(pool, ids):
    seq = SequenceBlocks(pool)
    start = seq.reuse_prefix(ids)
    assert seq.append_tokens(len(ids) - start, ids[start:]) is not None
    return seq, start


def test_a_shared_three_block_prefix_is_reused():
    pool = BlockPool(16, 4)
    first, start = admit(pool, prompt(1, 2, 3))
    assert start == 0
    second, start = admit(pool, prompt(1, 2, 3))
    assert start == 12 and second.table[:3] == first.table[:3] and second.table[3] != first.table[3]
    assert (pool.ref_counts[first.table[:3]] == 2).all()
    assert pool.stats.hits == 3 and pool.stats.tokens_reused == 12 and pool.stats.lookups == 2
    check_pool(pool, [first, second])


def test_a_different_token_in_block_two_reuses_only_block_one():
    pool = BlockPool(16, 4)
    first, _ = admit(pool, prompt(1, 2, 3))
    ids = prompt(1, 2, 3)
    ids[5] = 7  # block 2 (index 1) differs in one token
    second, start = admit(pool, ids)
    assert start == 4 and second.table[0] == first.table[0] and second.table[1] != first.table[1]
    # block 3 holds the same tokens as the first prompt's, but after a different prefix: not reused
    assert second.table[2] != first.table[2]
    assert block_key(block_key(b"", [1] * 4), [2] * 4) != block_key(block_key(b"", [1] * 4), ids[4:8])


def test_the_last_token_is_always_computed():
    pool = BlockPool(16, 4)
    ids = [5] * 8
    admit(pool, ids + [6])
    seq = SequenceBlocks(pool)
    assert seq.reuse_prefix(ids) == 4  # both blocks cached, but the prompt's last token is in block 2


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(4, 2)
    a, _ = admit(pool, [1, 1, 9])  # one full keyed block + one partial
    b, _ = admit(pool, [2, 2, 9])
    a0, b0 = a.table[0], b.table[0]
    a.release()
    b.release()
    assert pool.num_free == 2 and pool.evictable_blocks() == [a0, b0]  # partial blocks are not kept
    c, start = admit(pool, [1, 1, 9])  # reuses a's block: b's becomes the least recently used
    assert start == 2 and c.table[0] == a0 and pool.evictable_blocks() == [b0]
    c.release()
    assert pool.evictable_blocks() == [b0, a0]
    taken = pool.allocate(3)  # the 2 free blocks first, then the oldest evictable one
    assert taken[-1] == b0 and pool.stats.evictions == 1 and pool.evictable_blocks() == [a0]
    assert SequenceBlocks(pool).reuse_prefix([2, 2, 9]) == 0  # b's prefix was evicted
    assert SequenceBlocks(pool).reuse_prefix([1, 1, 9]) == 2  # a's survives
    check_pool(pool)


def test_no_eviction_while_free_blocks_remain():
    pool = BlockPool(4, 2)
    a, _ = admit(pool, [1, 1, 9])
    a.release()
    assert pool.allocate(3) is not None and pool.stats.evictions == 0 and pool.num_evictable == 1
    assert pool.allocate(2) is None and pool.num_evictable == 1  # only one available: nothing taken


def test_budget_splits_global_blocks_and_local_rings():
    per_token_layer = 2 * 2 * 8 * 2  # K and V, 2 kv heads, head dim 8, bf16
    budget = blocks_for_budget(10_000_000, 0.5, layers=4, kv_heads=2, head_dim=8, dtype_bytes=2, block_size=16)
    assert budget.bytes_per_block == 16 * per_token_layer * 4
    assert budget.num_blocks == 5_000_000 // budget.bytes_per_block and budget.local_blocks == 0
    mixed = blocks_for_budget(
        10_000_000, 0.5, 4, 2, 8, 2, 16, local_layers=3, window=40, max_seqs=8
    )  # ring: ceil(40/16)+1 = 4 blocks per sequence
    assert mixed.ring_blocks == 4 and mixed.local_blocks == 32
    assert mixed.bytes_per_local_block == 16 * per_token_layer * 3
    left = 5_000_000 - 32 * mixed.bytes_per_local_block
    assert mixed.num_blocks == left // (16 * per_token_layer)
    only_local = blocks_for_budget(1_000_000, 1.0, 2, 2, 8, 2, 16, local_layers=2, window=40)
    assert only_local.num_blocks == 0 and only_local.local_blocks == 1_000_000 // (16 * per_token_layer * 2)


def test_budget_refuses_what_does_not_fit():
    with pytest.raises(UsageError, match="memory fraction"):
        blocks_for_budget(1000, 1.5, 1, 1, 8, 2, 16)
    with pytest.raises(UsageError, match="no KV block"):
        blocks_for_budget(100, 1.0, 1, 1, 8, 2, 16)


def test_generated_tokens_key_their_blocks_too():
    """A conversation's next turn (prompt + reply + more) reuses the blocks the reply filled while it
    was generated one token at a time; a sequence that appended tokens without ids keys nothing more."""
    pool = BlockPool(16, 4)
    first, _ = admit(pool, [1, 2, 3, 4, 5, 6])
    for token in (7, 8, 9, 10, 11):
        assert first.append_tokens(1, [token]) is not None
    nxt = SequenceBlocks(pool)
    assert nxt.reuse_prefix(list(range(1, 12)) + [50, 51]) == 8 and nxt.table == first.table[:2]
    blind = SequenceBlocks(pool)
    blind.append_tokens(2, [60, 61])
    blind.append_tokens(1)
    blind.append_tokens(5, [62, 63, 64, 65, 66])
    assert SequenceBlocks(pool).reuse_prefix([60, 61, 62, 63, 64, 65, 66, 1, 2]) == 0  # not keyed misaligned
    with pytest.raises(ValueError, match="token ids for"):
        blind.append_tokens(2, [1])
