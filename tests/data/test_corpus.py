"""Corpus specs: the stdlib default, local txt/jsonl files, Hugging Face names, and their errors."""

import gzip
import json
import os
import pickle
import random
import sys
import sysconfig
from pathlib import Path

import pytest

import meshlm.data.corpus as corpus_module
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


def _rows(n):
    return "".join(json.dumps({"text": f"document {i} " + "x" * (i * 7 % 23)}) + "\n" for i in range(n))


@pytest.mark.parametrize("max_unit_bytes", [1, 50, 200, 10**6])
def test_units_cut_a_big_jsonl_at_line_starts(tmp_path, max_unit_bytes):
    path = tmp_path / "big.jsonl"
    path.write_text(_rows(40).replace("\n", "\n\n", 3))  # a few blank lines too
    corpus = open_corpus(str(path))
    units = corpus.units(max_unit_bytes=max_unit_bytes)
    assert [d for u in units for d in u.documents()] == list(corpus.documents())
    assert sum(u.nbytes for u in units) == path.stat().st_size
    data = path.read_bytes()
    for unit in units:
        (piece,) = unit.pieces
        assert piece.start == 0 or data[piece.start - 1 : piece.start] == b"\n"  # a line start
    if max_unit_bytes < path.stat().st_size:
        assert len(units) > 3 and units[1].label == f"{path}[{units[1].pieces[0].start}:{units[1].pieces[0].stop}]"
        assert all(
            u.nbytes <= max_unit_bytes or len(data[u.pieces[0].start :].split(b"\n")[0]) >= max_unit_bytes
            for u in units
        )
    else:
        assert [u.label for u in units] == [str(path)]


@pytest.mark.parametrize("max_unit_bytes", [1, 30, 100, 10**6])
def test_units_cut_a_big_txt_at_separators(tmp_path, max_unit_bytes):
    path = tmp_path / "big.txt"
    docs = [f"story {i}\n" + "line\n" * (i % 5) for i in range(30)]
    path.write_text("<|endoftext|>\n".join(docs))
    corpus = open_corpus(str(path))
    assert list(corpus.documents()) == docs
    units = corpus.units(max_unit_bytes=max_unit_bytes)
    assert [d for u in units for d in u.documents()] == docs
    assert len(units) == (30 if max_unit_bytes == 1 else 1 if max_unit_bytes == 10**6 else len(units))
    assert max_unit_bytes == 10**6 or len(units) > 1


def test_a_txt_document_too_long_for_bounded_memory_is_one_line(tmp_path, monkeypatch):
    """A big .txt without separator lines would be one document held whole; past the limit it is refused."""
    monkeypatch.setattr(corpus_module, "MAX_DOCUMENT_BYTES", 500)
    path = tmp_path / "book.txt"
    path.write_text("a line of a long book\n" * 100)  # 2,200 bytes, no separator
    with pytest.raises(UsageError, match=r"book\.txt: 2,200 bytes from byte 0 hold no line with only <\|endoftext\|>"):
        open_corpus(str(path)).units(max_unit_bytes=100)
    assert len(open_corpus(str(path)).units(max_unit_bytes=10_000)) == 1  # a whole small file is one document


def test_a_glob_reads_only_supported_files(tmp_path):
    (tmp_path / "part-0.jsonl").write_text('{"text": "kept"}\n')
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / "part-0.jsonl.crc").write_bytes(b"\x00\x01")
    assert list(open_corpus(str(tmp_path / "*")).documents()) == ["kept"]
    with pytest.raises(UsageError, match=r"matched no .* files \(first: .*_SUCCESS\)"):
        open_corpus(str(tmp_path / "_*"))


def test_units_group_small_files_in_order(tmp_path):
    for i in range(6):
        (tmp_path / f"f{i}.txt").write_text(f"file {i} " * 5)  # 35 bytes each
    corpus = open_corpus(str(tmp_path))
    units = corpus.units(max_unit_bytes=100)
    assert [len(u.pieces) for u in units] == [2, 2, 2]
    assert units[0].label == f"{tmp_path / 'f0.txt'} .. {tmp_path / 'f1.txt'} (2 inputs)"
    assert [u.nbytes for u in units] == [70, 70, 70]
    assert [d for u in units for d in u.documents()] == list(corpus.documents())
    assert len(corpus.units()) == 1


def test_unit_pickles_and_reads_the_same_after(tmp_path):
    (tmp_path / "d.jsonl").write_text(_rows(20))
    units = open_corpus(str(tmp_path / "d.jsonl")).units(max_unit_bytes=100)
    again = pickle.loads(pickle.dumps(units))
    assert again == units
    assert [list(u.documents()) for u in again] == [list(u.documents()) for u in units]


def test_folder_reads_every_supported_kind_recursively(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.json").write_text(json.dumps([{"text": "from json"}]))
    (tmp_path / "a" / "y.jsonl.gz").write_bytes(gzip.compress(b'{"text": "from gzip"}\n'))
    (tmp_path / "b.txt").write_text("from txt")
    (tmp_path / "c.csv").write_text("skipped")
    (tmp_path / "d.parquet.gz").write_bytes(b"skipped too")
    assert list(open_corpus(str(tmp_path)).documents()) == ["from json", "from gzip", "from txt"]


def test_empty_sources_say_so(tmp_path):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.jsonl").write_text("\n\n")
    corpus = open_corpus(str(tmp_path))
    with pytest.raises(UsageError, match=r"holds no documents"):
        list(corpus.documents())
    with pytest.raises(UsageError, match=r"holds no documents"):
        open_corpus(str(tmp_path / "a.txt")).units()


def test_fingerprint_covers_every_file_without_reading_them(tmp_path, monkeypatch):
    for name in ("a.txt", "b.jsonl", "c.txt"):
        (tmp_path / name).write_text("x" if name.endswith("txt") else '{"text": "x"}\n')
    before = open_corpus(str(tmp_path)).fingerprint
    stat = (tmp_path / "c.txt").stat()
    os.utime(tmp_path / "c.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert open_corpus(str(tmp_path)).fingerprint != before
    monkeypatch.setattr(Path, "open", lambda *a, **k: pytest.fail("the fingerprint read a file"))
    monkeypatch.setattr("builtins.open", lambda *a, **k: pytest.fail("the fingerprint read a file"))
    assert open_corpus(str(tmp_path)).fingerprint


def test_hf_streams_a_local_dataset_by_shards(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []
    real = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(k) or real(*a, **k))
    folder = tmp_path / "ds" / "data"
    folder.mkdir(parents=True)
    (folder / "train-0.jsonl").write_text('{"text": "a1"}\n{"text": "a2"}\n')
    (folder / "train-1.jsonl").write_text('{"text": "b1"}\n{"text": ""}\n{"text": "b3"}\n')
    corpus = open_corpus(f"hf:{tmp_path / 'ds'}")
    assert list(corpus.documents()) == ["a1", "a2", "b1", "b3"]
    units = corpus.units()
    assert [u.label for u in units] == [f"hf:{tmp_path / 'ds'}:train[shard {i}/2]" for i in range(2)]
    assert [u.nbytes for u in units] == [(folder / f"train-{i}.jsonl").stat().st_size for i in range(2)]
    assert [list(pickle.loads(pickle.dumps(u)).documents()) for u in units] == [["a1", "a2"], ["b1", "b3"]]
    assert calls and all(k.get("streaming") is True for k in calls)
    before = corpus.fingerprint
    (folder / "train-1.jsonl").write_text('{"text": "changed"}\n')
    assert open_corpus(f"hf:{tmp_path / 'ds'}").fingerprint != before
    with pytest.raises(UsageError, match=r"has no 'body' column \(columns: text\); pass --text_field"):
        list(open_corpus(f"hf:{tmp_path / 'ds'}", text_field="body").documents())


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_units_equal_documents_with_small_scan_windows(tmp_path, monkeypatch, kind):
    monkeypatch.setattr("meshlm.data.readers._SCAN_BYTES", 16)  # every cut search crosses windows
    monkeypatch.setattr("meshlm.data.readers._SEPARATOR_SLACK", 8)
    rng = random.Random(0)
    docs = ["".join(rng.choice("ab \n") for _ in range(rng.randint(1, 60))) + "\n" for _ in range(60)]
    docs = [d for d in docs if d.strip()]
    path = tmp_path / f"r.{kind}"
    if kind == "txt":
        path.write_text("".join(d + rng.choice(["<|endoftext|>\n", "<|endoftext|> \n"]) for d in docs))
    else:
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = open_corpus(str(path))
    assert list(corpus.documents()) == docs
    for max_unit_bytes in (1, 17, 64, 301):
        units = corpus.units(max_unit_bytes=max_unit_bytes)
        assert [d for u in units for d in u.documents()] == docs, max_unit_bytes
        assert sum(u.nbytes for u in units) == path.stat().st_size
        assert max_unit_bytes < 64 or len(units) < len(docs)
