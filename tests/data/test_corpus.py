"""Corpus specs: the stdlib default, local txt/jsonl files, Hugging Face names, and their errors."""

import json
import os
import sys
import sysconfig
from pathlib import Path

import pytest

from meshlm.data import cache_root, is_synthetic, open_corpus
from meshlm.data.corpus import stdlib_files
from meshlm.errors import UsageError


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


def test_stdlib_files_are_sorted_sources_without_tests():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert all(p.suffix == ".py" for p in files)
    for name in rel:
        folders = name.split("/")[:-1]
        assert not {"test", "tests", "site-packages"} & set(folders), name
    assert "os.py" in rel and "json/decoder.py" in rel
    assert stdlib_files() == files


def test_stdlib_corpus_yields_file_texts_in_order():
    corpus = open_corpus("stdlib")
    docs = corpus.documents()
    first_nonempty = next(p for p in stdlib_files() if p.read_text(errors="replace").strip())
    assert next(docs) == first_nonempty.read_text(errors="replace")
    assert open_corpus("STDLIB").fingerprint == corpus.fingerprint


def test_txt_file_directory_and_glob(tmp_path):
    (tmp_path / "b.txt").write_text("second document")
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n")
    (tmp_path / "notes.md").write_text("ignored in a directory")
    (tmp_path / "empty.txt").write_text("  \n")

    assert list(open_corpus(str(tmp_path / "a.txt")).documents()) == ["first document"]
    assert list(open_corpus(str(tmp_path)).documents()) == [
        "first document",
        "second document",
        "third",
    ]
    assert list(open_corpus(str(tmp_path / "*.txt")).documents()) == [
        "first document",
        "second document",
    ]
    assert list(open_corpus(str(tmp_path / "**" / "*.jsonl")).documents()) == ["third"]
    # An explicitly named file of any suffix is read as one text document.
    assert list(open_corpus(str(tmp_path / "notes.md")).documents()) == ["ignored in a directory"]


def test_jsonl_text_field_and_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"text": "alpha", "body": "one"}, {"text": "beta", "body": "two"}]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert list(open_corpus(str(path)).documents()) == ["alpha", "beta"]
    assert list(open_corpus(str(path), text_field="body").documents()) == ["one", "two"]


def test_fingerprint_follows_file_contents(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one")
    before = open_corpus(str(path)).fingerprint
    assert open_corpus(str(path)).fingerprint == before
    path.write_text("one two")
    assert open_corpus(str(path)).fingerprint != before
    assert open_corpus(str(path), text_field="body").fingerprint != open_corpus(str(path)).fingerprint


def test_synthetic_spec():
    assert is_synthetic("synthetic") and is_synthetic(" Synthetic ")
    assert not is_synthetic("stdlib")
    with pytest.raises(UsageError, match="no text corpus"):
        open_corpus("synthetic")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no/such/file.txt", "unknown dataset 'no/such/file.txt'.*stdlib, synthetic, hf:NAME"),
        ("hf:", "names no dataset"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(UsageError, match=message):
        open_corpus(spec)


def test_empty_glob_and_empty_directory(tmp_path):
    with pytest.raises(UsageError, match=r"glob .* matched no files"):
        open_corpus(str(tmp_path / "*.jsonl"))
    (tmp_path / "only.md").write_text("x")
    with pytest.raises(
        UsageError, match=r"holds no \.txt, \.jsonl, \.json \(each also \.gz or \.zst\) or \.parquet files"
    ):
        open_corpus(str(tmp_path))


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(UsageError, match=r"bad\.jsonl:2: not a valid UTF-8 JSON line"):
        list(open_corpus(str(path)).documents())

    path.write_bytes(b'{"text": "fine"}\n\n{"text": "\xff"}\n')
    with pytest.raises(UsageError, match=r"bad\.jsonl:3: not a valid UTF-8 JSON line"):
        list(open_corpus(str(path)).documents())

    path.write_text('{"text": "fine"}\n{"content": "x"}\n')
    with pytest.raises(UsageError, match=r"bad\.jsonl:2: no string field 'text'"):
        list(open_corpus(str(path)).documents())

    path.write_text("[1, 2]\n")
    with pytest.raises(UsageError, match=r"bad\.jsonl:1: no string field 'text'"):
        list(open_corpus(str(path)).documents())


def test_hf_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(UsageError, match="pip install datasets"):
        open_corpus("hf:roneneldan/TinyStories:validation")


def test_hf_spec_parsing(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", object())  # importable; nothing is loaded yet
    corpus = open_corpus("hf:org/name:validation")
    assert (corpus.name, corpus.split) == ("org/name", "validation")
    assert open_corpus("hf:org/name").split == "train"


def test_cache_root_precedence(tmp_path, monkeypatch):
    assert cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv("MESHLM_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path(os.path.expanduser("~")) / ".cache" / "meshlm"
