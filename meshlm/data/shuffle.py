"""Shuffled row orders in O(1) memory: a keyed bijection on [0, n), evaluated for any batch of indices.

`Bijection(n, key)` is a balanced Feistel network on the next even power of two above n with cycle
walking (an output at or past n is fed through again until it lands below n), vectorised over numpy
arrays: position i of the order is `perm(i)`, so a step's rows cost O(batch) whatever the row count,
and no permutation of the whole corpus is ever drawn or stored. Keys come from `np.random.SeedSequence`
of a tuple such as (seed, epoch). It is written here because it is a few lines of numpy; the data
libraries that offer one (e.g. Grain's index sampler) would bring a dependency and their own loader
model for this alone.

`RowOrder` is the order a loader reads: rows held out for evaluation (a fixed sample keyed by
`EVAL_SEED`) and, per epoch, the remaining rows shuffled by (seed, epoch).
"""

from __future__ import annotations

import numpy as np

EVAL_SEED = 0x5EED_E7A1  # the held-out sample's own key: the same rows whatever --seed is
_ROUNDS = 6
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's): every input bit reaches every output bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Bijection:
    """A keyed permutation of [0, n): `perm(i)` for an int array i (values in [0, n)) gives the
    permuted positions; the same (n, key) gives the same order on any machine."""

    def __init__(self, n: int, key: tuple[int, ...]):
        self.n = int(n)
        bits = max(2, int(self.n - 1).bit_length() if self.n > 1 else 2)
        self.half = (bits + 1) // 2
        self.half_mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence([int(k) % (1 << 64) for k in key]).generate_state(_ROUNDS, np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h, m = np.uint64(self.half), self.half_mask
        left, right = x >> h, x & m
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & m)
        return (left << h) | right

    def __call__(self, index) -> np.ndarray:
        i = np.asarray(index, dtype=np.int64)
        if self.n <= 1:
            return np.zeros_like(i)
        x = self._feistel(i.astype(np.uint64))
        outside = x >= np.uint64(self.n)
        while outside.any():  # cycle walking: at most a few passes, since n is over a quarter of the domain
            x[outside] = self._feistel(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


class RowOrder:
    """The rows of a packed stream in reading order: `held(i)` the i-th held-out row, `train(epoch, i)`
    the i-th training row of an epoch, for arrays of positions.

    Held-out rows are positions [0, n_held) of the `EVAL_SEED` order; training rows are the rest, read
    in the (seed, epoch) order of their own count (unshuffled: in increasing row id)."""

    def __init__(self, num_rows: int, n_held: int, seed: int, shuffle: bool = True):
        self.num_rows, self.n_held, self.seed, self.shuffle = int(num_rows), int(n_held), int(seed), shuffle
        self.n_train = self.num_rows - self.n_held
        self._eval = Bijection(self.num_rows, (EVAL_SEED,)) if self.n_held else None
        self._epoch_orders: dict[int, Bijection] = {}
        self._sorted_train: np.ndarray | None = None

    def held(self, index) -> np.ndarray:
        i = np.asarray(index, dtype=np.int64)
        return self._eval(i) if self._eval is not None else i[:0]

    def train(self, epoch, index) -> np.ndarray:
        """Row ids of training positions `index` (each in [0, n_train)) of `epoch` (a scalar or an array)."""
        index = np.asarray(index, dtype=np.int64)
        epochs = np.broadcast_to(np.asarray(epoch, dtype=np.int64), index.shape)
        if not self.shuffle:
            return self._unshuffled(index)
        within = np.empty_like(index)
        for e in np.unique(epochs):
            sel = epochs == e
            within[sel] = self._order(int(e))(index[sel])
        return within if self._eval is None else self._eval(self.n_held + within)

    def _order(self, epoch: int) -> Bijection:
        if epoch not in self._epoch_orders:
            if len(self._epoch_orders) > 4:
                self._epoch_orders.clear()
            self._epoch_orders[epoch] = Bijection(self.n_train, (self.seed, epoch))
        return self._epoch_orders[epoch]

    def _unshuffled(self, index: np.ndarray) -> np.ndarray:
        if self._eval is None:
            return index
        if self._sorted_train is None:  # unshuffled with rows held out: the other rows in increasing order
            keep = np.ones(self.num_rows, bool)
            keep[self.held(np.arange(self.n_held))] = False
            self._sorted_train = np.flatnonzero(keep)
        return self._sorted_train[index]


class Rows:
    """A read-only sequence of row ids computed on demand (`len`, an int, a slice or an index array)."""

    def __init__(self, length: int, lookup):
        self.length, self.lookup = int(length), lookup

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self.lookup(np.arange(*key.indices(self.length)))
        if np.ndim(key) == 0:
            k = int(key)
            if not -self.length <= k < self.length:
                raise IndexError(k)
            return int(self.lookup(np.array([k % self.length]))[0])
        return self.lookup(np.asarray(key, dtype=np.int64))

    def __array__(self, dtype=None, copy=None):
        out = self.lookup(np.arange(self.length))
        return out if dtype is None else out.astype(dtype)

    def __iter__(self):
        return iter(np.asarray(self))

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()
