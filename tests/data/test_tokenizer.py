"""Tokenizers: BPE training on a capped stdlib, the cache, loading tokenizer.json files, errors."""

import json
import os

import pytest
import tokenizers

from meshlm.data import EOS_TOKEN, SyntheticTokenizer, Tokenizer, load_tokenizer, train_tokenizer
from meshlm.data.corpus import open_corpus, stdlib_files
from meshlm.data.tokenizer import _capped, sample_documents
from meshlm.errors import UsageError

TRAIN_CHARS = 400_000  # a small, fast slice of the stdlib
VOCAB = 400


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tokcache")


@pytest.fixture(scope="module")
def tok(cache):
    return train_tokenizer("stdlib", VOCAB, cache_dir=cache, train_chars=TRAIN_CHARS)


def test_trained_bpe_has_vocab_and_eos(tok, cache):
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == VOCAB
    assert tok.eos_id == tok._tok.token_to_id(EOS_TOKEN)
    assert tok.decode([tok.eos_id]) == EOS_TOKEN
    assert tok.path.is_file() and tok.path.is_relative_to(cache / "tokenizers")


def test_round_trip_on_stdlib_text(tok):
    files = stdlib_files()
    # The first file is in the training slice; the last one lies far beyond it.
    for path in (files[0], files[len(files) // 2], files[-1]):
        text = path.read_text(errors="replace")
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())  # the merges do compress
    for text in ["héllo wörld ✓ 日本語 🙂", "", "\t\n  x"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(["a b", "def f():"]) == [tok.encode("a b"), tok.encode("def f():")]


def test_literal_eos_text_in_training_data_is_plain_text(tok):
    text = f"before {EOS_TOKEN} after"
    assert tok.encode(text).count(tok.eos_id) == 1  # a prompt may name special tokens
    for ids in (tok.encode(text, special_as_text=True), tok.encode_batch([text], True)[0]):
        assert tok.eos_id not in ids
        assert tok.decode(ids) == text
    assert tok.encode(text).count(tok.eos_id) == 1  # the plain-text copy left this one alone


def test_cache_hit_does_not_retrain(tok, cache, monkeypatch):
    mtime = os.stat(tok.path).st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("trained again instead of using the cache")

    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", no_training)
    again = train_tokenizer("stdlib", VOCAB, cache_dir=cache, train_chars=TRAIN_CHARS)
    assert again.path == tok.path
    assert os.stat(again.path).st_mtime_ns == mtime
    assert again.fingerprint == tok.fingerprint
    assert again.encode("import os") == tok.encode("import os")


def test_cache_key_covers_vocab_and_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    first = train_tokenizer(str(tmp_path / "a.txt"), 300, cache_dir=tmp_path / "c")
    other_vocab = train_tokenizer(str(tmp_path / "a.txt"), 290, cache_dir=tmp_path / "c")
    assert other_vocab.path != first.path
    (tmp_path / "a.txt").write_text("a different corpus entirely\n" * 50)
    assert train_tokenizer(str(tmp_path / "a.txt"), 300, cache_dir=tmp_path / "c").path != first.path


def test_training_is_deterministic(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(300)))
    a = train_tokenizer(str(tmp_path / "a.txt"), 320, cache_dir=tmp_path / "c1")
    b = train_tokenizer(str(tmp_path / "a.txt"), 320, cache_dir=tmp_path / "c2")
    assert a.path != b.path and a.path.read_text() == b.path.read_text()


def test_env_cache_dir_and_status_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "envcache"))
    (tmp_path / "a.txt").write_text("hello world, hello tokenizer\n" * 20)
    tok = load_tokenizer(None, str(tmp_path / "a.txt"), 300)
    assert tok.path.is_relative_to(tmp_path / "envcache" / "tokenizers")
    assert "trained tokenizer" in capsys.readouterr().err


def test_capped_training_text_is_a_deterministic_prefix():
    docs = ["abcd", "efgh", "ijkl"]
    assert _capped(iter(docs), 6) == ["abcd", "ef"]
    assert _capped(iter(docs), 100) == docs


def test_training_sample_is_spread_over_the_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr("meshlm.data.tokenizer._SAMPLE_UNIT_BYTES", 1000)
    rows = [{"text": f"{part} document {i:04d}"} for part in ("head", "middle", "tail") for i in range(300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = open_corpus(str(tmp_path / "d.jsonl"))
    sample = sample_documents(corpus, 2000)
    assert 1500 <= sum(map(len, sample)) <= 2000
    assert {s.split()[0] for s in sample} == {"head", "middle", "tail"}  # not only the first characters
    assert any(d.startswith(sample[-1]) for d in corpus.units(1000)[-1].documents())  # down to the last unit
    assert sample_documents(corpus, 2000) == sample
    every = list(corpus.documents())
    assert sample_documents(corpus, 10**6) == every  # a corpus smaller than the budget is read whole


def test_save_and_load(tok, tmp_path):
    path = tok.save(tmp_path / "export")
    assert path == tmp_path / "export" / "tokenizer.json" and tok.path == path
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())["eos_token"] == EOS_TOKEN
    for spec in (tmp_path / "export", path):
        loaded = load_tokenizer(str(spec), "stdlib", 99999)  # a given tokenizer is used as is
        assert loaded.vocab_size == tok.vocab_size and loaded.eos_id == tok.eos_id
        assert loaded.encode("for i in range(3):") == tok.encode("for i in range(3):")


def _word_level(tmp_path, vocab, eos_config=None):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tmp_path.mkdir(exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    if eos_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_config}))
    return tmp_path


def test_load_finds_eos_from_config_or_known_names(tmp_path):
    vocab = {"a": 0, "</s>": 1, "<eos>": 2}
    assert Tokenizer.from_file(_word_level(tmp_path / "plain", vocab)).eos_id == 1
    configured = _word_level(tmp_path / "cfg", vocab, eos_config={"content": "<eos>"})
    assert Tokenizer.from_file(configured).eos_id == 2
    with pytest.raises(UsageError, match="has no end-of-text token"):
        Tokenizer.from_file(_word_level(tmp_path / "none", {"a": 0, "b": 1}))


def test_synthetic_tokenizer():
    tok = load_tokenizer(None, "synthetic", 1000)
    assert isinstance(tok, SyntheticTokenizer)
    assert (tok.vocab_size, tok.eos_id) == (1000, 999)
    assert tok.decode(tok.encode("hello")) == "hello"


def test_tokenizer_errors(tmp_path):
    with pytest.raises(UsageError, match="not found: pass a tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing"), "stdlib", 512)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path), "stdlib", 512)
    with pytest.raises(UsageError, match="too small for a byte-level BPE"):
        load_tokenizer(None, "stdlib", 100)
    with pytest.raises(UsageError, match="unknown dataset"):
        load_tokenizer(None, str(tmp_path / "nope.txt"), 512)
    (tmp_path / "a.txt").write_text("some text to train on")
    with pytest.raises(UsageError, match="set MESHLM_CACHE to a writable folder"):
        load_tokenizer(None, str(tmp_path / "a.txt"), 300, cache_dir=tmp_path / "a.txt")
