"""Keyed row orders: a bijection on [0, n) for any n, fixed by its key, cheap at any row count; held-out
and training rows split the rows between them."""

import time

import numpy as np
import pytest

from meshlm.data.loader import held_out_rows
from meshlm.data.shuffle import Bijection, RowOrder, Rows


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 31, 64, 100, 1000, 4097])
def test_every_row_appears_exactly_once(n):
    order = Bijection(n, (3, 0))(np.arange(n))
    np.testing.assert_array_equal(np.sort(order), np.arange(n))


def test_the_key_fixes_the_order():
    n = 1000
    a, again, other_epoch = (Bijection(n, key)(np.arange(n)) for key in [(1, 0), (1, 0), (1, 1)])
    np.testing.assert_array_equal(a, again)
    assert not np.array_equal(a, other_epoch)
    assert not np.array_equal(a, np.arange(n))  # shuffled, not the identity
    np.testing.assert_array_equal(Bijection(n, (1, 0))(np.arange(500, 600)), a[500:600])  # any slice alone


def test_a_batch_of_a_huge_order_is_cheap_and_distinct():
    n = 10**12 + 39  # no array of this size could be drawn
    t0 = time.perf_counter()
    got = Bijection(n, (0, 5))(np.arange(10**12, 10**12 + 4096))
    assert time.perf_counter() - t0 < 5.0
    assert len(np.unique(got)) == 4096 and got.min() >= 0 and got.max() < n


def test_held_out_and_training_rows_split_the_rows():
    order = RowOrder(500, 25, seed=7)
    held = order.held(np.arange(25))
    np.testing.assert_array_equal(held, held_out_rows(500, 0.05))
    for epoch in (0, 3):
        train = order.train(epoch, np.arange(475))
        np.testing.assert_array_equal(np.sort(np.concatenate([held, train])), np.arange(500))
    assert not np.array_equal(order.train(0, np.arange(475)), order.train(1, np.arange(475)))
    unshuffled = RowOrder(500, 25, seed=7, shuffle=False).train(0, np.arange(475))
    np.testing.assert_array_equal(unshuffled, np.setdiff1d(np.arange(500), held))


def test_rows_is_a_lazy_sequence():
    rows = Rows(10, lambda i: np.asarray(i) * 3)
    assert len(rows) == 10 and rows[2] == 6 and rows[-1] == 27
    np.testing.assert_array_equal(rows[2:5], [6, 9, 12])
    assert rows.tolist() == [3 * i for i in range(10)]
    with pytest.raises(IndexError):
        rows[10]
