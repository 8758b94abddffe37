"""The token cache is checked when opened and rebuilt when damaged; a file truncated under a run's memory
map stops the reader with one line instead of SIGBUS."""

import io
import os

import numpy as np
import pytest
from rich.console import Console

from meshlm.data import make_loader, token_cache, tokenize_corpus
from meshlm.data.token_cache import DamagedCache, open_token_cache, read_stream_header
from meshlm.errors import UsageError

SEQ, BATCH = 16, 4


class Bytes:
    """A byte tokenizer: ids 0..255 for bytes, 256 the end of text; no training, so tests stay fast."""

    vocab_size, eos_id, fingerprint = 257, 256, "bytes-257"

    def encode(self, text):
        return list(text.encode())


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("def main():\n    return 0\n" * 40)
    return str(path)


def tokenize(corpus, cache):
    """(the tokens, what tokenize_corpus printed)."""
    out = io.StringIO()
    tokens = tokenize_corpus(corpus, Bytes(), cache_dir=cache, console=Console(file=out, width=400))
    return np.asarray(tokens), out.getvalue()


@pytest.fixture
def cached(corpus, tmp_path):
    """(the cache folder, its one token file, the tokens it holds)."""
    cache = tmp_path / "cache"
    tokens, _ = tokenize(corpus, cache)
    (path,) = (cache / "tokens").glob("*.npy")
    return cache, path, tokens


def test_a_whole_cache_is_read_back_memory_mapped(corpus, cached):
    cache, path, want = cached
    got, said = tokenize(corpus, cache)
    np.testing.assert_array_equal(got, want)
    assert said == "" and isinstance(tokenize_corpus(corpus, Bytes(), cache_dir=cache).base, np.memmap)


def damage_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damage_random_bytes(path):
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))


def damage_id_beyond_vocab(path):
    tokens = np.load(path)
    tokens[len(tokens) // 2] = Bytes.vocab_size  # one id the model's embedding does not have
    np.save(path, tokens)


@pytest.mark.parametrize(
    "damage, why",
    [
        (damage_truncate, "is 1,065 bytes and its header says 2,130"),
        (damage_random_bytes, "has no readable .npy header"),
        (damage_id_beyond_vocab, "holds id 257, outside the tokenizer's vocabulary of 257"),
    ],
)
def test_a_damaged_cache_is_rebuilt_with_one_line(corpus, cached, damage, why):
    cache, path, want = cached
    damage(path)
    got, said = tokenize(corpus, cache)
    np.testing.assert_array_equal(got, want)
    note, done = said.splitlines()  # the note, then the usual line of a tokenization
    assert (
        note.startswith(f"[meshlm] the token cache {path} ")
        and why in note
        and note.endswith(f"tokenizing {corpus} again")
    )
    assert done.startswith(f"[meshlm] tokenized {corpus}")
    np.testing.assert_array_equal(open_token_cache(path, np.uint16, Bytes.vocab_size), want)  # rewritten whole


def test_the_id_check_reads_chunk_by_chunk_to_the_last(cached, monkeypatch):
    _, path, want = cached
    monkeypatch.setattr(token_cache, "ID_CHECK_CHUNK", 7)
    assert len(open_token_cache(path, np.uint16, Bytes.vocab_size)) == len(want)
    tokens = np.load(path)
    tokens[-1] = 300
    np.save(path, tokens)
    with pytest.raises(DamagedCache, match="holds id 300"):
        open_token_cache(path, np.uint16, Bytes.vocab_size)


def test_a_cache_of_another_dtype_is_not_read(cached):
    _, path, want = cached
    np.save(path, want.astype(np.int64))
    with pytest.raises(DamagedCache, match="int64 array"):
        open_token_cache(path, np.uint16, Bytes.vocab_size)


def test_a_cache_truncated_while_training_stops_the_reader_with_one_line(corpus, cached):
    """Reading rows past the end of a truncated memory-mapped file would kill the process with SIGBUS."""
    cache, _, want = cached
    loader = make_loader(corpus, Bytes(), SEQ, BATCH, cache_dir=cache)
    assert loader.batch(0)["inputs"].shape == (BATCH, SEQ)
    shard = loader.tokens.folder / f"{loader.tokens.units[0]['stem']}.npy"  # the loader reads prepared shards
    with open(shard, "r+b") as f:
        f.truncate(256)
    with pytest.raises(UsageError, match="shrank from .* to 256 bytes while this run was reading it; run again"):
        loader.batch(1)
    again = make_loader(corpus, Bytes(), SEQ, BATCH, cache_dir=cache, prefetch=0)  # the next run prepares it again
    np.testing.assert_array_equal(again.tokens[0 : len(again.tokens)], want)


def test_a_streams_header_is_read_without_keeping_a_descriptor(tmp_path):
    """What opening many shards checks per file: header and size, the file closed again."""
    path = tmp_path / "s.npy"
    np.save(path, np.arange(300, dtype=np.uint16))
    fds = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    offset, length = read_stream_header(path, np.uint16)
    assert length == 300 and offset + 300 * 2 == path.stat().st_size
    if fds is not None:
        assert set(os.listdir("/proc/self/fd")) == fds
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 2)
    with pytest.raises(DamagedCache, match="bytes and its header says"):
        read_stream_header(path, np.uint16)
    with pytest.raises(DamagedCache, match="not a stream of uint32"):
        read_stream_header(path, np.uint32)
