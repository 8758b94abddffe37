"""Held-out evaluation rows: never in a training batch, the same whatever the seed, split by process
like a training batch; without --eval_split the training stream is the (seed, epoch) order of every row."""

import json

import numpy as np
import pytest

from meshlm.data import EvalBatches, held_out_rows, load_tokenizer, make_eval_batches, make_loader, pack_rows
from meshlm.data.shuffle import Bijection
from meshlm.errors import UsageError

SEQ, BATCH = 16, 4
WORDS = "the a of model mesh shard token data loader batch row epoch seed step def return".split()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("heldoutcache")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(1)
    docs = [" ".join(rng.choice(WORDS, size=rng.integers(5, 80))) for _ in range(150)]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


@pytest.fixture(scope="module")
def tok(dataset, cache):
    return load_tokenizer(None, dataset, 300, cache_dir=cache)


def rows_of(loader, batch):
    """The corpus row ids of a packed batch, found by matching each row's tokens."""
    T = loader.seq_len
    index = {loader.tokens[r * T : r * T + T + 1].tobytes(): r for r in range(loader.num_rows)}
    full = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1).astype(loader.tokens.dtype)
    return [index[row.tobytes()] for row in full]


def test_held_out_rows_are_fixed_and_seed_independent():
    a = held_out_rows(1000, 0.05)
    assert len(a) == 50 and len(set(a.tolist())) == 50 and a.max() < 1000
    np.testing.assert_array_equal(a, held_out_rows(1000, 0.05))
    assert not np.array_equal(np.sort(a), np.arange(50))  # a sample spread over the corpus, not its head
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(UsageError, match="strictly between 0 and 1"):
            held_out_rows(1000, bad)


def test_held_out_rows_never_train(dataset, tok, cache):
    loader = make_loader(dataset, tok, SEQ, BATCH, seed=3, cache_dir=cache, eval_split=0.1)
    other_seed = make_loader(dataset, tok, SEQ, BATCH, seed=4, cache_dir=cache, eval_split=0.1)
    np.testing.assert_array_equal(loader.held_out, other_seed.held_out)  # the same rows whatever the seed
    held = set(loader.held_out.tolist())
    assert len(held) == int(np.ceil(0.1 * loader.num_rows))
    seen = set()
    for step in range(3 * loader.steps_per_epoch):  # three epochs: every training row, three times
        ids = rows_of(loader, loader.batch(step))
        assert not held.intersection(ids), step
        seen.update(ids)
    assert seen == set(range(loader.num_rows)) - held  # and every other row trains
    evals = make_eval_batches(loader, None, None)
    assert isinstance(evals, EvalBatches) and evals.n_batches == min(10, len(held) // BATCH)
    for b, batch in enumerate(evals.batches()):
        assert rows_of(loader, batch) == loader.held_out[b * BATCH : (b + 1) * BATCH].tolist()


def test_no_eval_flag_leaves_the_training_stream_unchanged(dataset, tok, cache):
    loader = make_loader(dataset, tok, SEQ, BATCH, seed=5, cache_dir=cache)
    assert loader.held_out is None and "held_out" not in loader.state()
    for step in (0, 1, loader.steps_per_epoch + 2):
        epoch, k = divmod(step, loader.steps_per_epoch)
        ids = Bijection(loader.num_rows, (5, epoch))(np.arange(k * BATCH, (k + 1) * BATCH))  # every row, keyed
        T = SEQ
        want = pack_rows(np.stack([loader.tokens[r * T : r * T + T + 1] for r in ids]), tok.eos_id)
        got = loader.batch(step)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_each_process_reads_only_its_rows_of_an_eval_batch(dataset, tok, cache):
    whole = make_eval_batches(make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache, eval_split=0.2), None, 2)
    parts = [
        make_eval_batches(
            make_loader(dataset, tok, SEQ, BATCH, process_index=p, process_count=2, cache_dir=cache, eval_split=0.2),
            None,
            2,
        )
        for p in range(2)
    ]
    for b in range(2):
        assert parts[0].global_rows(b).tolist() + parts[1].global_rows(b).tolist() == whole.global_rows(b).tolist()
        for key, value in whole.batch(b).items():
            np.testing.assert_array_equal(np.concatenate([p.batch(b)[key] for p in parts]), value)


def test_eval_dataset_and_synthetic_eval_batches(dataset, tok, cache):
    loader = make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache)
    other = make_eval_batches(loader, dataset, 3, cache_dir=cache)
    assert other.n_batches == 3 and len(other.batches()) == 3 and other.batches() is other.batches()
    synth = make_loader("synthetic", tok, SEQ, BATCH, seed=2)
    evals = make_eval_batches(synth, None, None)
    first = evals.batch(0)
    assert first["inputs"].shape == (BATCH, SEQ) and first["loss_mask"].all()
    for step in range(4):  # drawn from a stream no training step uses
        assert not np.array_equal(synth.batch(step)["inputs"], first["inputs"])


def test_too_few_eval_rows_is_one_clear_error(dataset, tok, cache):
    loader = make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache, eval_split=0.01)
    with pytest.raises(UsageError, match="raise --eval_split or lower --eval_batches or --batch_size"):
        make_eval_batches(loader, None, 1000)


def test_resuming_with_another_eval_split_is_refused(dataset, tok, cache):
    split = make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache, eval_split=0.1)
    plain = make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache)
    with pytest.raises(UsageError, match="resume with --eval_split=0.1"):
        plain.restore(split.state())
    with pytest.raises(UsageError, match="resume without --eval_split"):
        split.restore(plain.state())
    split.restore({**split.state(), "step": 7})
    assert split.step == 7
