"""The paged KV cache's host side: a pool of fixed-size blocks, each sequence's block table, the prefix cache.

    pool = BlockPool(num_blocks=1024, block_size=16)
    seq = SequenceBlocks(pool)
    start = seq.reuse_prefix(prompt_ids)          # tokens whose KV cached blocks already hold
    grant = seq.append_tokens(len(prompt_ids) - start, prompt_ids[start:])   # None: preempt someone
    child, copies = seq.fork()                    # another sample of the same prompt

Blocks are reference-counted; a sequence never writes into a block another one holds (copy-on-write:
a `Grant` lists the (source, destination) block copies to run before the step). A full block is keyed
by a hash of its parent's key and its token ids, so equal keys mean equal prefixes; a freed keyed
block stays reusable until the pool evicts it, least recently used first, when no free block is left.
A ring table (`ring_blocks`) serves a sliding-window layer: position p in slot p mod ring size.
How it fits the engine and the kernels: docs/paged.md.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Sequence

import numpy as np

from meshlm.errors import UsageError

ROOT_KEY = b""  # the parent key of a sequence's first block


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: a hash of its parent block's key and its own token ids
    (the same in every process, unlike Python's salted `hash`)."""
    tokens = np.asarray(token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(parent + tokens, digest_size=16).digest()


@dataclasses.dataclass
class PrefixStats:
    """Prefix-cache counters: requests looked up, blocks reused (hits), tokens whose prefill was
    skipped, cached blocks evicted to make room."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    evictions: int = 0


@dataclasses.dataclass
class Grant:
    """What one `append_tokens` took: the blocks newly added to the table and the (source,
    destination) block copies that must run before the step writes (copy-on-write)."""

    blocks: list[int]
    copies: list[tuple[int, int]]


class BlockPool:
    """`num_blocks` blocks of `block_size` token slots with reference counts. A block is free (count 0,
    no key), evictable (count 0, keyed: its contents may still serve a prefix) or held (count > 0)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise UsageError(
                f"a block pool needs at least one block of at least one slot, not {num_blocks} x {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = np.zeros(num_blocks, np.int32)
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._block_of_key: dict[bytes, int] = {}
        self._key_of_block: dict[int, bytes] = {}
        self.stats = PrefixStats()

    @property
    def num_available(self) -> int:
        """Blocks `allocate` can hand out now: the free ones and the evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, the next to be evicted first."""
        return list(self._evictable)

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks held once each, free ones first, then evicting least recently used cached blocks;
        None (and nothing taken) when fewer than `n` are available."""
        if n > self.num_available:
            return None
        taken = [self._take_one() for _ in range(n)]
        self.ref_counts[taken] += 1
        return taken

    def _take_one(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._block_of_key[self._key_of_block.pop(block)]
        self.stats.evictions += 1
        return block

    def share(self, blocks: Sequence[int]) -> None:
        """One more holder for each of `blocks` (held or evictable)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"block {b} is free: allocate it rather than share it")
                del self._evictable[b]
            self.ref_counts[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """One holder fewer for each of `blocks`; a block no one holds goes back to the free list or,
        when keyed, to the most recent end of the evictable list (freed in order: a sequence frees its
        table tail first so its prefix stays longest)."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not held")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._key_of_block:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def cache(self, block: int, key: bytes) -> None:
        """Key a full held block for reuse. A key already cached keeps its block (this one stays
        unkeyed); a block keeps its first key."""
        if key in self._block_of_key or block in self._key_of_block:
            return
        self._block_of_key[key] = block
        self._key_of_block[block] = key

    def lookup(self, key: bytes) -> int | None:
        return self._block_of_key.get(key)

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The longest run of cached full blocks that spell the start of `token_ids` and their keys,
        held once more each (counted in `stats`). At least the last token is left out, for prefill to
        compute its logits."""
        size, found, keys, parent = self.block_size, [], [], ROOT_KEY
        for start in range(0, len(token_ids) - size, size):  # block ends before the last token
            key = block_key(parent, token_ids[start : start + size])
            block = self.lookup(key)
            if block is None:
                break
            found.append(block)
            keys.append(key)
            parent = key
        self.share(found)
        self.stats.lookups += 1
        self.stats.hits += len(found)
        self.stats.tokens_reused += len(found) * size
        return found, keys


class SequenceBlocks:
    """One sequence's block table in `pool`, growing as tokens arrive. With `ring_blocks` R, the table
    stops at R blocks and position p lives in slot p mod (R · block_size) (a sliding-window layer's
    ring, as `meshlm.models.layers.LayerCache` lays it out); ring blocks are never prefix-cached."""

    def __init__(self, pool: BlockPool, ring_blocks: int = 0):
        self.pool, self.ring_blocks = pool, ring_blocks
        self.table: list[int] = []
        self.num_tokens = 0
        self._keys: list[bytes] = []  # keys of the table's first full blocks
        # token ids of the blocks not keyed yet (from block len(_keys) on); None once some are unknown
        self._pending: list[int] | None = []

    @property
    def ring_slots(self) -> int:
        return self.ring_blocks * self.pool.block_size

    def reuse_prefix(self, token_ids: Sequence[int]) -> int:
        """On an empty table: take the pool's cached blocks for the start of `token_ids`; returns how
        many tokens they hold (prefill starts there)."""
        if self.table or self.ring_blocks:
            return 0
        blocks, keys = self.pool.match_prefix(token_ids)
        self.table, self._keys = list(blocks), keys
        self.num_tokens = len(blocks) * self.pool.block_size
        return self.num_tokens

    def blocks_needed(self, n: int) -> int:
        """How many blocks `append_tokens(n)` would take from the pool (new ones and copies)."""
        return len(self._new_block_indices(n)) + len(self._shared_written(n))

    def append_tokens(self, n: int, token_ids: Sequence[int] | None = None) -> Grant | None:
        """Room for `n` more tokens: blocks added to the table and copies of shared blocks the tokens
        would be written into. None, with nothing changed, when the pool cannot supply them (the
        scheduler then preempts a sequence). `token_ids` (the n tokens) key the blocks they fill; after
        one call without them, no later block of the sequence is keyed."""
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"{len(token_ids)} token ids for {n} tokens")
        new_indices, shared = self._new_block_indices(n), self._shared_written(n)
        taken = self.pool.allocate(len(new_indices) + len(shared))
        if taken is None:
            return None
        copies = []
        for index, fresh in zip(shared, taken[len(new_indices) :], strict=True):
            copies.append((self.table[index], fresh))
            self.pool.free([self.table[index]])
            self.table[index] = fresh
        self.table.extend(taken[: len(new_indices)])
        self.num_tokens += n
        if token_ids is None or self.ring_blocks:
            self._pending = None  # tokens unknown from here: no later block is keyed
        elif self._pending is not None:
            self._key_full_blocks(token_ids)
        return Grant(taken[: len(new_indices)], copies)

    def _new_block_indices(self, n: int) -> range:
        have = len(self.table)
        want = math.ceil((self.num_tokens + n) / self.pool.block_size)
        if self.ring_blocks:
            want = min(want, self.ring_blocks)
        return range(have, max(have, want))

    def _written_indices(self, n: int) -> list[int]:
        """Table indices of the blocks the next `n` tokens land in that exist already."""
        size, have = self.pool.block_size, len(self.table)
        positions = range(self.num_tokens, self.num_tokens + n)
        if self.ring_blocks:
            indices = {(p % self.ring_slots) // size for p in positions[: self.ring_slots]}
        else:
            indices = {p // size for p in positions[:size]}  # only the first block can exist already
        return sorted(i for i in indices if i < have)

    def _shared_written(self, n: int) -> list[int]:
        return [i for i in self._written_indices(n) if self.pool.ref_counts[self.table[i]] > 1]

    def _key_full_blocks(self, token_ids: Sequence[int]) -> None:
        size = self.pool.block_size
        self._pending.extend(int(t) for t in token_ids)
        while len(self._pending) >= size and len(self._keys) < len(self.table):
            parent = self._keys[-1] if self._keys else ROOT_KEY
            key = block_key(parent, self._pending[:size])
            self.pool.cache(self.table[len(self._keys)], key)
            self._keys.append(key)
            del self._pending[:size]

    def fork(self) -> tuple[SequenceBlocks, list[tuple[int, int]]]:
        """A new sequence sharing this one's blocks (another sample of the same prompt). The last
        block, when partly filled, is copied for the child at once: returns (child, [(source,
        destination)]), or raises `MemoryError` when no block is left for the copy."""
        child = SequenceBlocks(self.pool, self.ring_blocks)
        self.pool.share(self.table)
        child.table, child.num_tokens = list(self.table), self.num_tokens
        child._keys = list(self._keys)
        child._pending = None if self._pending is None else list(self._pending)
        partial = self.num_tokens % self.pool.block_size and not self.ring_blocks
        if not partial:
            return child, []
        fresh = self.pool.allocate(1)
        if fresh is None:
            self.pool.free(child.table)
            raise MemoryError("no free block for the forked sequence's last block")
        source = child.table[-1]
        self.pool.free([source])
        child.table[-1] = fresh[0]
        return child, [(source, fresh[0])]

    def release(self) -> None:
        """Give every block back (finished, or preempted for recomputation: the keyed blocks stay
        cached, so a preempted sequence's prompt is likely found again). Frees the table's tail first."""
        self.pool.free(self.table[::-1])
        self.table, self.num_tokens, self._keys, self._pending = [], 0, [], []

    def slots(self, start: int, n: int) -> np.ndarray:
        """[n] int32 flat slot ids (block · block_size + offset) of positions start .. start+n-1."""
        size = self.pool.block_size
        positions = np.arange(start, start + n)
        if self.ring_blocks:
            positions = positions % self.ring_slots
        table = np.asarray(self.table, np.int32)
        return (table[positions // size] * size + positions % size).astype(np.int32)

    def padded_table(self, max_blocks: int, pad: int = 0) -> np.ndarray:
        """[max_blocks] int32: the table, then `pad` (any valid block: masked by the lengths)."""
        if len(self.table) > max_blocks:
            raise ValueError(f"the table has {len(self.table)} blocks, more than {max_blocks}")
        return np.asarray(self.table + [pad] * (max_blocks - len(self.table)), np.int32)


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """How a memory budget is split: `num_blocks` blocks of the global layers' pages (shared by all
    sequences), `local_blocks` blocks of the sliding-window layers' rings (`ring_blocks` per sequence)."""

    num_blocks: int
    local_blocks: int
    ring_blocks: int
    bytes_per_block: int
    bytes_per_local_block: int


def ring_blocks_for_window(window: int, block_size: int) -> int:
    """Blocks of a sliding-window layer's ring: ceil(W / block_size) + 1, so a step may write up to
    block_size + 1 tokens per row without overwriting a key its queries still need."""
    return math.ceil(window / block_size) + 1


def blocks_for_budget(
    bytes_free: int,
    fraction: float,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    block_size: int,
    local_layers: int = 0,
    window: int = 0,
    max_seqs: int = 1,
) -> KVBudget:
    """Blocks that fit in `fraction` of `bytes_free`. A block id spans every global layer's K and V
    pages; the sliding-window layers (`local_layers` of the `layers`) get their own pool, reserved first:
    `max_seqs` rings of `ring_blocks_for_window` blocks; the global layers take the rest."""
    if not 0 < fraction <= 1:
        raise UsageError(f"the KV cache's memory fraction must be in (0, 1], not {fraction}")
    if local_layers and window < 1:
        raise UsageError("local layers need their sliding window (window >= 1)")
    slot_bytes = 2 * kv_heads * head_dim * dtype_bytes  # one token's K and V in one layer
    budget = int(bytes_free * fraction)
    global_layers = layers - local_layers
    per_block = block_size * slot_bytes * global_layers
    per_local = block_size * slot_bytes * local_layers
    ring = ring_blocks_for_window(window, block_size) if local_layers else 0
    if not global_layers:
        return KVBudget(0, budget // per_local, ring, 0, per_local)
    local_blocks = ring * max_seqs
    num_blocks = (budget - local_blocks * per_local) // per_block
    if num_blocks < 1:
        raise UsageError(
            f"{budget} bytes hold no KV block of {per_block} bytes beside {local_blocks} ring blocks: "
            "lower the batch or raise the memory fraction"
        )
    return KVBudget(num_blocks, local_blocks, ring, per_block, per_local)


__all__ = [
    "ROOT_KEY",
    "BlockPool",
    "Grant",
    "KVBudget",
    "PrefixStats",
    "SequenceBlocks",
    "block_key",
    "blocks_for_budget",
    "ring_blocks_for_window",
]
