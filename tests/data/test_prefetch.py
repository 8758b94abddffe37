"""Reading ahead on a thread: the same batches as reading in place, bounded, re-positioned on a jump,
errors raised in the caller with their message, stopped by close()."""

import gc
import time

import numpy as np
import pytest

from meshlm.data.loader import make_loader
from meshlm.data.prefetch import Prefetcher
from meshlm.data.tokenizer import SyntheticTokenizer


def test_batches_come_in_order_and_a_jump_repositions():
    seen = []
    fetch = Prefetcher(lambda s: seen.append(s) or {"step": s}, depth=2)
    assert [fetch.get(s)["step"] for s in range(4)] == [0, 1, 2, 3]
    assert fetch.get(10)["step"] == 10 and fetch.get(11)["step"] == 11  # a restore to step 10
    fetch.close()
    assert not fetch.running and 10 in seen


def test_the_queue_is_bounded():
    made = []
    fetch = Prefetcher(lambda s: made.append(s) or s, depth=2)
    fetch.get(0)
    time.sleep(0.5)
    assert max(made) <= 0 + 2 + 1  # two queued and at most one waiting to be put
    fetch.close()


def test_an_error_in_the_thread_is_raised_in_the_caller():
    def produce(step):
        if step == 2:
            raise ValueError(f"row {step} is damaged")
        return step

    fetch = Prefetcher(produce, depth=3)
    assert fetch.get(0) == 0 and fetch.get(1) == 1
    with pytest.raises(ValueError, match="row 2 is damaged"):
        fetch.get(2)
    assert not fetch.running


def test_a_loader_reads_ahead_the_batches_it_would_read_in_place():
    tok = SyntheticTokenizer(64)
    ahead = make_loader("synthetic", tok, 8, 4, seed=1, prefetch=3)
    in_place = make_loader("synthetic", tok, 8, 4, seed=1, prefetch=0)
    with ahead:
        for _ in range(5):
            a, b = next(ahead), next(in_place)
            np.testing.assert_array_equal(a["inputs"], b["inputs"])
        ahead.restore({"step": 1})
        np.testing.assert_array_equal(next(ahead)["inputs"], in_place.batch(1)["inputs"])
        assert ahead.step == 2
    assert not ahead._prefetcher.running


def test_a_dropped_loader_stops_its_thread():
    loader = make_loader("synthetic", SyntheticTokenizer(64), 8, 4, prefetch=2)
    next(loader)
    thread = loader._prefetcher._thread
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_loaders_read_error_reaches_the_training_thread():
    loader = make_loader("synthetic", SyntheticTokenizer(64), 8, 4, prefetch=2)
    good = loader.batch

    def failing(step):
        if step == 3:
            raise OSError(f"unit-00007.npy could not be read at step {step}")
        return good(step)

    loader.batch = failing
    with loader:
        for _ in range(3):
            next(loader)
        with pytest.raises(OSError, match="unit-00007.npy could not be read at step 3"):
            next(loader)
