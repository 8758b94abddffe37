"""Packing invariants, per-process sharding, determinism, resume, caching and loader errors."""

import json

import numpy as np
import pytest

import meshlm.data.corpus
from meshlm.data import DataLoader, load_tokenizer, make_loader, pack_rows, tokenize_corpus
from meshlm.errors import UsageError

SEQ = 32
BATCH = 8
WORDS = "the a of model mesh shard token data loader batch row epoch seed step def return".split()


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("loadercache")


@pytest.fixture(scope="module")
def docs():
    """Documents from 1 to 120 words: some share a row, some span several rows."""
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=rng.integers(1, 120))) for _ in range(200)]
    docs[7] += " <|endoftext|> written in a document is text, not a boundary"
    return docs


@pytest.fixture(scope="module")
def dataset(docs, tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


@pytest.fixture(scope="module")
def tok(dataset, cache):
    return load_tokenizer(None, dataset, 300, cache_dir=cache)


@pytest.fixture(scope="module")
def loader(dataset, tok, cache):
    return make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache)


def test_pack_rows_by_hand():
    eos = 0
    rows = np.array([[5, 6, 0, 7, 0, 0, 8, 9, 4]])  # an empty-looking document: eos right after eos
    b = pack_rows(rows, eos)
    np.testing.assert_array_equal(b["inputs"], [[5, 6, 0, 7, 0, 0, 8, 9]])
    np.testing.assert_array_equal(b["targets"], [[6, 0, 7, 0, 0, 8, 9, 4]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 3, 4, 4]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 0, 0, 1]])
    np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 0, 1, 0, 0, 1, 1]])
    assert {k: v.dtype for k, v in b.items()} == {
        "inputs": np.int32,
        "targets": np.int32,
        "positions": np.int32,
        "segment_ids": np.int32,
        "loss_mask": np.float32,
    }


def _check_packing(b, eos_id):
    inputs, targets, pos, seg, mask = (b[k] for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask"))
    assert inputs.shape == targets.shape == pos.shape == seg.shape == mask.shape == (inputs.shape[0], SEQ)
    np.testing.assert_array_equal(targets[:, :-1], inputs[:, 1:])
    starts = np.ones_like(inputs, dtype=bool)
    starts[:, 1:] = inputs[:, :-1] == eos_id  # a document starts after each eos and at the row start
    # positions restart at each document start and count up by one otherwise
    assert (pos[starts] == 0).all()
    np.testing.assert_array_equal(pos[:, 1:][~starts[:, 1:]], pos[:, :-1][~starts[:, 1:]] + 1)
    # segment ids are 1 at the row start and step up by one exactly at document starts
    assert (seg[:, 0] == 1).all()
    np.testing.assert_array_equal(np.diff(seg, axis=1), starts[:, 1:].astype(int))
    # the loss is masked exactly where the target starts another document
    target_seg = np.concatenate([seg[:, 1:], seg[:, -1:] + (inputs[:, -1:] == eos_id)], axis=1)
    np.testing.assert_array_equal(mask == 0, target_seg != seg)
    np.testing.assert_array_equal(mask == 0, inputs == eos_id)


def test_packing_invariants(loader, tok):
    for step in range(5):
        b = loader.batch(step)
        _check_packing(b, tok.eos_id)
    assert b["loss_mask"].min() == 0 and (b["segment_ids"] > 1).any()  # boundaries were seen


def test_stream_is_documents_joined_by_eos(loader, tok, docs):
    tokens = np.asarray(loader.tokens)
    assert tokens[-1] == tok.eos_id and (tokens == tok.eos_id).sum() == len(docs)
    pieces = np.split(tokens, np.flatnonzero(tokens == tok.eos_id) + 1)[:-1]
    assert [tok.decode(p[:-1]) for p in pieces] == docs


def test_unshuffled_epoch_makes_every_token_a_target_once(dataset, tok, cache):
    plain = make_loader(dataset, tok, SEQ, BATCH, shuffle=False, cache_dir=cache)
    targets = np.concatenate([plain.batch(s)["targets"].ravel() for s in range(plain.steps_per_epoch)])
    n = plain.steps_per_epoch * BATCH * SEQ
    np.testing.assert_array_equal(targets, np.asarray(plain.tokens[1 : n + 1]))
    assert plain.num_rows == (len(plain.tokens) - 1) // SEQ


def test_epochs_reshuffle_and_cover_distinct_rows(loader):
    def epoch_rows(e):
        steps = range(e * loader.steps_per_epoch, (e + 1) * loader.steps_per_epoch)
        return [tuple(r) for s in steps for r in loader.batch(s)["inputs"]]

    first, second = epoch_rows(0), epoch_rows(1)
    assert len(set(first)) == len(first)  # no row twice within an epoch
    assert first != second and len(set(first) & set(second)) > 0.8 * len(first)


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_split_the_global_batch(dataset, tok, cache, loader, processes):
    parts = [make_loader(dataset, tok, SEQ, BATCH, p, processes, cache_dir=cache) for p in range(processes)]
    for step in (
        0,
        1,
        loader.steps_per_epoch,
        loader.steps_per_epoch + 3,
    ):  # across an epoch boundary
        whole = loader.batch(step)
        pieces = [part.batch(step) for part in parts]
        assert all(piece["inputs"].shape == (BATCH // processes, SEQ) for piece in pieces)
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in pieces]), whole[key])


def test_seed_determinism(dataset, tok, cache, loader):
    same = make_loader(dataset, tok, SEQ, BATCH, seed=0, cache_dir=cache)
    other = make_loader(dataset, tok, SEQ, BATCH, seed=1, cache_dir=cache)
    for step in range(3):
        a, b = loader.batch(step), same.batch(step)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(loader.batch(0)["inputs"], other.batch(0)["inputs"])


def test_resume_equals_fresh_iterator(dataset, tok, cache, capsys):
    fresh = make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache)
    it = iter(fresh)
    k = fresh.steps_per_epoch + 2  # resume in the second epoch
    for _ in range(k):
        next(it)
    state = fresh.state()
    assert state["step"] == k and state["epoch"] == 1
    expected = [next(it) for _ in range(3)]

    resumed = make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache)
    resumed.restore(json.loads(json.dumps(state)))  # the state survives a JSON checkpoint
    started = make_loader(dataset, tok, SEQ, BATCH, start_step=k, cache_dir=cache)
    for want in expected:
        for got in (next(resumed), next(started)):
            assert all(np.array_equal(want[key], got[key]) for key in want)
    assert resumed.step == started.step == k + 3

    with pytest.raises(UsageError, match="resume with seed 0"):
        make_loader(dataset, tok, SEQ, BATCH, seed=5, cache_dir=cache).restore(state)
    assert "earlier order" not in capsys.readouterr().err
    older = {key: value for key, value in state.items() if key != "order"}  # saved before keyed orders
    make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache).restore(older)
    assert "earlier order of rows" in capsys.readouterr().err
    with pytest.raises(UsageError, match="resume with the same dataset"):
        make_loader(dataset, tok, SEQ // 2, BATCH, cache_dir=cache).restore(state)


def test_tokens_are_prepared_once(dataset, tok, cache, loader):
    files = sorted(p for p in (cache / "shards").rglob("*") if p.is_file())
    assert any(p.name == "manifest.json" for p in files)
    mtimes = [p.stat().st_mtime_ns for p in files]
    again = make_loader(dataset, tok, SEQ, BATCH, cache_dir=cache, prefetch=0).tokens  # read back, not tokenized
    np.testing.assert_array_equal(again[0 : len(again)], loader.tokens[0 : len(loader.tokens)])
    np.testing.assert_array_equal(again[0 : len(again)], tokenize_corpus(dataset, tok, cache_dir=cache))
    assert [p.stat().st_mtime_ns for p in files] == mtimes


def test_default_stdlib_dataset_end_to_end(monkeypatch):
    """The default spec, on the first few stdlib files to stay fast."""
    few = meshlm.data.corpus.stdlib_files()[:12]
    monkeypatch.setattr(meshlm.data.corpus, "stdlib_files", lambda: few)
    tok = load_tokenizer(None, "stdlib", 320)
    stdlib = make_loader("stdlib", tok, SEQ, 4)
    _check_packing(next(stdlib), tok.eos_id)
    text = few[0].read_text()
    assert tok.decode(np.asarray(stdlib.tokens[: len(tok.encode(text))])) == text


def test_synthetic(tok):
    synth = load_tokenizer(None, "synthetic", 1000)
    whole = make_loader("synthetic", synth, SEQ, BATCH, seed=3)
    b = next(whole)
    assert b["inputs"].shape == (BATCH, SEQ) and b["inputs"].dtype == np.int32
    assert 0 <= b["inputs"].min() and b["inputs"].max() < 1000 and len(np.unique(b["inputs"])) > 100
    np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    np.testing.assert_array_equal(b["positions"], np.tile(np.arange(SEQ), (BATCH, 1)))
    assert (b["segment_ids"] == 1).all() and (b["loss_mask"] == 1).all()
    assert not np.array_equal(whole.batch(1)["inputs"], b["inputs"])
    np.testing.assert_array_equal(make_loader("synthetic", synth, SEQ, BATCH, seed=3).batch(0)["inputs"], b["inputs"])
    halves = [make_loader("synthetic", synth, SEQ, BATCH, p, 2, seed=3).batch(0) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), b["inputs"])
    # a real tokenizer's vocabulary works too: random ids below its vocab_size
    assert make_loader("synthetic", tok, SEQ, BATCH).batch(0)["inputs"].max() < tok.vocab_size


def test_loader_errors(dataset, tok, cache, tmp_path):
    with pytest.raises(UsageError, match="not divisible by the 3 processes; use a multiple of 3"):
        make_loader(dataset, tok, SEQ, BATCH, 0, 3, cache_dir=cache)
    with pytest.raises(UsageError, match=r"process_index 2 is not in \[0, process_count=2\)"):
        make_loader(dataset, tok, SEQ, BATCH, 2, 2, cache_dir=cache)
    with pytest.raises(UsageError, match="must be >= 1"):
        make_loader(dataset, tok, 0, BATCH, cache_dir=cache)
    (tmp_path / "tiny.txt").write_text("just a few words")
    with pytest.raises(UsageError, match="fewer than the global batch of 8; use a smaller batch"):
        DataLoader(str(tmp_path / "tiny.txt"), tok, SEQ, BATCH)
    with pytest.raises(UsageError, match="matched no files"):
        make_loader(str(tmp_path / "*.jsonl"), tok, SEQ, BATCH)
