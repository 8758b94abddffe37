"""Preparing token shards: the same ids as the one-process token cache, resumed, reused, split between processes."""

import errno
import io
import json
import os
import threading
import time

import numpy as np
import pytest
from rich.console import Console

from meshlm.data import prepare as prep
from meshlm.data import shards as shards_module
from meshlm.data.corpus import open_corpus
from meshlm.data.loader import tokenize_corpus
from meshlm.data.shards import MANIFEST, unit_stem
from meshlm.data.tokenizer import train_tokenizer
from meshlm.errors import UsageError

UNIT = 1000  # input bytes per unit: the corpus below is 5 units or more (small files grouped, a file cut)
WORDS = "the a river stone lamp quiet runs over under <|endoftext|> def return café 42 ( ) : \n".split(" ")


def make_corpus(root, n_files=4, seed=0):
    """A folder of .txt files (one document each) and a .jsonl file (one document a line)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)

    def text(n):
        return " ".join(rng.choice(WORDS, n))

    for i in range(n_files):
        (root / f"doc{i}.txt").write_text(text(40 + 30 * i))
    lines = [json.dumps({"text": text(int(rng.integers(1, 60)))}) for _ in range(25)]
    (root / "more.jsonl").write_text("\n".join(lines[:10] + [""] + lines[10:]) + "\n")
    return str(root)


def reference_ids(spec, tok) -> np.ndarray:
    """The corpus encoded in one go, the way the one-process token cache always has: each document's ids
    (special-token text kept as text), then eos."""
    docs = list(open_corpus(spec).documents())
    ids = tok.encode_batch(docs, special_as_text=True) if hasattr(tok, "encode_batch") else map(tok.encode, docs)
    return np.array([i for one in ids for i in (*one, tok.eos_id)], np.uint16)


@pytest.fixture
def corpus(tmp_path):
    spec = make_corpus(tmp_path / "corpus")
    return spec, train_tokenizer(spec, 300, cache_dir=tmp_path / "cache"), tmp_path / "cache"


def quiet():
    out = io.StringIO()
    return Console(file=out, width=200), out


@pytest.mark.parametrize("where", ["workers", "here"])
def test_shards_hold_the_token_caches_ids(corpus, tmp_path, monkeypatch, where):
    """In worker processes (what a large corpus gets) and in this process (a small one), the same ids."""
    spec, tok, _ = corpus
    cache = tmp_path / "cache"
    monkeypatch.setattr(prep, "IN_PROCESS_BYTES", 0 if where == "workers" else 1 << 30)
    pools = []

    class CountedPool(prep.cf.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(prep.cf, "ProcessPoolExecutor", CountedPool)
    console, log = quiet()
    shards = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=2, console=console)
    assert len(pools) == (1 if where == "workers" else 0)
    expected = reference_ids(spec, tok)
    np.testing.assert_array_equal(tokenize_corpus(spec, tok, cache_dir=cache, console=quiet()[0]), expected)
    n = len(open_corpus(spec).units(UNIT))
    assert n >= 5 and len(shards.units) == n and len(shards) == len(expected) and shards.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(shards), expected)
    starts = np.cumsum([0] + [u["tokens"] for u in shards.units])
    ends = np.concatenate([shards.document_ends(u) + starts[u] for u in range(n)])
    assert shards.documents == len(ends) == int((expected == tok.eos_id).sum())  # eos only at document ends
    np.testing.assert_array_equal(np.flatnonzero(expected == tok.eos_id) + 1, ends)
    bounds = np.cumsum([u["tokens"] for u in shards.units])
    for b in bounds[:-1]:
        np.testing.assert_array_equal(shards[b - 3 : b + 4], expected[b - 3 : b + 4])
    assert f"{n} units ({n} encoded now)" in log.getvalue() and "more.jsonl: 25 documents" in log.getvalue()


def test_a_second_call_reuses_the_shards(corpus, monkeypatch):
    spec, tok, cache = corpus
    first = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=2, console=quiet()[0])

    def no_encoding(*a, **k):
        raise AssertionError("units encoded again")

    monkeypatch.setattr(prep, "_encode_units", no_encoding)
    again = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=2, console=quiet()[0])
    assert again.folder == first.folder
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))


def test_an_interrupted_preparation_does_only_the_missing_units(corpus):
    spec, tok, cache = corpus
    first = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=1, console=quiet()[0])
    whole, folder = np.asarray(first), first.folder
    for name in (f"{unit_stem(2)}.npy", f"{unit_stem(2)}.json", MANIFEST):  # as if stopped while unit 2 was written
        (folder / name).unlink()
    stale, live = folder / f".{unit_stem(2)}.npy.h.123.ab.tmp", folder / f".{unit_stem(2)}.npy.other.456.cd.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (0, os.stat(stale).st_mtime - prep.STALE_TMP_AGE - 5))  # its writer long gone
    live.write_bytes(b"another preparation's, still growing")
    others = [i for i in range(len(first.units)) if i != 2]
    kept = {i: os.stat(folder / f"{unit_stem(i)}.npy").st_mtime_ns for i in others}
    console, log = quiet()
    again = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=2, console=console)
    assert "(1 encoded now)" in log.getvalue()
    assert kept == {i: os.stat(folder / f"{unit_stem(i)}.npy").st_mtime_ns for i in others}
    assert list(folder.glob(".*.tmp")) == [live]  # a live writer's temp file is left to it
    np.testing.assert_array_equal(np.asarray(again), whole)


def test_a_resumed_preparation_keeps_its_first_unit_size(corpus):
    """Stopped, then run again with another unit size (`meshlm train` takes its default): the first
    preparation's units are kept and completed, not started over."""
    spec, tok, cache = corpus
    first = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=1, console=quiet()[0])
    whole, folder, n = np.asarray(first), first.folder, len(first.units)
    for name in (f"{unit_stem(1)}.npy", f"{unit_stem(1)}.json", MANIFEST):
        (folder / name).unlink()
    console, log = quiet()
    again = prep.prepare_tokens(spec, tok, cache_dir=cache, workers=1, console=console)  # the default size
    assert again.folder == folder and len(again.units) == n and "(1 encoded now)" in log.getvalue()
    np.testing.assert_array_equal(np.asarray(again), whole)


def test_a_damaged_unit_is_prepared_again(corpus):
    spec, tok, cache = corpus
    first = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=1, console=quiet()[0])
    whole = np.asarray(first)
    with open(first.folder / f"{unit_stem(3)}.npy", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    console, log = quiet()
    again = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=1, console=console)
    assert f"{unit_stem(3)}.npy is" in log.getvalue() and "(1 encoded now)" in log.getvalue()
    np.testing.assert_array_equal(np.asarray(again), whole)


class ByteTokenizer:
    """Not a meshlm Tokenizer: encoded in this process, and may change the corpus while it runs."""

    eos_id, vocab_size, fingerprint = 255, 256, "bytes-v1"

    def __init__(self, touch=None):
        self.touch = touch

    def encode(self, text):
        if self.touch is not None:
            self.touch.write_text("changed while preparing")
        return list(text.encode("utf-8")[:50].replace(b"\xff", b""))


def test_other_tokenizers_are_encoded_here(corpus):
    spec, _, cache = corpus
    shards = prep.prepare_tokens(spec, ByteTokenizer(), cache_dir=cache, unit_bytes=UNIT, console=quiet()[0])
    np.testing.assert_array_equal(np.asarray(shards), reference_ids(spec, ByteTokenizer()))


def test_a_corpus_changed_while_prepared_asks_to_run_again(corpus):
    spec, _, cache = corpus
    with pytest.raises(UsageError, match="changed while it was being tokenized; run again"):
        prep.prepare_tokens(
            spec,
            ByteTokenizer(touch=prep.Path(spec) / "doc0.txt"),
            cache_dir=cache,
            unit_bytes=UNIT,
            console=quiet()[0],
        )
    assert len(list((cache / "shards").glob("*/unit-?????.npy"))) == len(
        open_corpus(spec).units(UNIT)
    )  # nothing prepared is deleted


def test_units_are_a_sixty_fourth_of_the_corpus_within_bounds(tmp_path, monkeypatch):
    spec = make_corpus(tmp_path / "corpus")
    assert prep.unit_size(prep.open_corpus(spec)) == prep.MIN_UNIT_BYTES  # a small corpus: the least
    monkeypatch.setattr(prep, "MIN_UNIT_BYTES", 10)
    total = sum(u.nbytes for u in prep.open_corpus(spec).units())
    assert prep.unit_size(prep.open_corpus(spec)) == total // prep.TARGET_UNITS


def test_waiting_for_another_process_times_out_in_one_line(corpus):
    spec, tok, cache = corpus
    with pytest.raises(UsageError, match="waited 1 s for the other processes' units"):
        prep.prepare_tokens(
            spec,
            tok,
            cache_dir=cache,
            unit_bytes=UNIT,
            workers=1,
            process_index=0,
            process_count=2,
            peer_timeout=1,
            console=quiet()[0],
        )
    folder = prep.shard_folder(prep.open_corpus(spec), tok, cache)
    n = len(open_corpus(spec).units(UNIT))
    assert sorted(p.name for p in folder.glob("unit-*.json")) == [f"{unit_stem(i)}.json" for i in range(0, n, 2)]


def test_too_many_open_files_deletes_nothing(corpus, monkeypatch):
    """A descriptor limit reached while opening the shards is not damage: one line, every unit kept."""
    spec, tok, cache = corpus
    first = prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=1, console=quiet()[0])
    kept = sorted(p.name for p in first.folder.iterdir())

    def no_descriptors(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(shards_module, "read_stream_header", no_descriptors)
    with pytest.raises(UsageError, match="ulimit -n"):
        prep.prepare_tokens(spec, tok, cache_dir=cache, unit_bytes=UNIT, workers=1, console=quiet()[0])
    assert sorted(p.name for p in first.folder.iterdir()) == kept


def test_a_unit_finished_by_another_preparation_meanwhile_is_taken_as_done(corpus, tmp_path):
    """Two preparations of one folder: the other one finishes the unit (and, older, removed this one's
    temp files); this one's rename then fails and it takes the other's record."""
    spec, tok, _ = corpus
    folder, unit = tmp_path / "shared", open_corpus(spec).units(UNIT)[0]
    folder.mkdir()
    theirs = {"stem": unit_stem(0), "tokens": 3, "documents": 1}

    def encode(texts):
        for tmp in folder.glob(".*.tmp"):
            tmp.unlink()
        (folder / f"{unit_stem(0)}.json").write_text(json.dumps(theirs))
        return tok.encode_batch(texts, special_as_text=True)

    assert prep.write_unit(unit, folder, 0, encode, tok.eos_id, np.uint16, lambda *n: None) == theirs
    assert not list(folder.glob(".*.tmp"))


def test_the_unit_size_record_is_never_left_empty(tmp_path, monkeypatch):
    """A process stopped while writing units.json leaves no file behind to block the folder."""
    folder = tmp_path / "f"
    folder.mkdir()

    def crash(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(prep.json, "dumps", crash)
        with pytest.raises(KeyboardInterrupt):
            prep.settled_unit_bytes(folder, 5000)
    assert list(folder.iterdir()) == []
    assert prep.settled_unit_bytes(folder, 7000) == 7000
    assert prep.settled_unit_bytes(folder, 9000) == 7000  # the first one decides
    assert [p.name for p in folder.iterdir()] == [prep.UNITS_RECORD]


def test_a_unit_still_being_written_counts_as_progress(tmp_path, monkeypatch):
    """Another process's unit may take longer than the timeout: its temp file growing keeps the wait alive."""
    monkeypatch.setattr(prep, "_POLL", 0.05)
    done, tmp = tmp_path / f"{unit_stem(1)}.json", tmp_path / f".{unit_stem(1)}.npy.h.1.ab.tmp"

    def other_process():
        with open(tmp, "wb") as f:
            for _ in range(12):  # 1.2 s of writing against a 0.5 s timeout
                f.write(b"ids")
                f.flush()
                time.sleep(0.1)
        done.write_text("{}")

    writer = threading.Thread(target=other_process)
    writer.start()
    try:
        prep._wait_for([done], "the other processes' units", timeout=0.5)
    finally:
        writer.join()
    assert done.exists()
    with pytest.raises(UsageError, match="waited 0 s"):
        prep._wait_for([tmp_path / "never.json"], "the other processes' units", timeout=0.3)
