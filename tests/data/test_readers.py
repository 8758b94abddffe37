"""Corpus inputs: .txt separators, .json, .gz and .zst compression, parquet columns, and the one-line
errors for content that is not what its name says."""

import gzip
import json

import pytest

from meshlm.data.corpus import open_corpus
from meshlm.errors import UsageError

zstandard = pytest.importorskip("zstandard")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

ROWS = [{"text": "alpha one", "id": 1}, {"text": "", "id": 2}, {"text": "beta two", "id": 3}]
TEXTS = ["alpha one", "beta two"]


def _docs(path, **kw):
    return list(open_corpus(str(path), **kw).documents())


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_txt_separator_lines_split_documents(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first line\nsecond\n<|endoftext|>\nnext doc\n<|endoftext|>  \n\n<|endoftext|>\nlast")
    assert _docs(path) == ["first line\nsecond\n", "next doc\n", "last"]
    path.write_text("one document\n<|endoftext|> with words after it\nstill the same one\n")
    assert _docs(path) == [path.read_text()]  # only a line holding the separator alone splits


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".zst", lambda b: zstandard.compress(b))])
def test_compressed_inputs_equal_plain(tmp_path, suffix, compress):
    plain = {
        "a.txt": b"doc a\n<|endoftext|>\ndoc b\n",
        "b.jsonl": _jsonl(ROWS),
        "c.json": json.dumps(ROWS).encode(),
    }
    for name, data in plain.items():
        (tmp_path / "plain").mkdir(exist_ok=True)
        (tmp_path / "packed").mkdir(exist_ok=True)
        (tmp_path / "plain" / name).write_bytes(data)
        (tmp_path / "packed" / (name + suffix)).write_bytes(compress(data))
        assert _docs(tmp_path / "packed" / (name + suffix)) == _docs(tmp_path / "plain" / name)
    assert _docs(tmp_path / "packed") == _docs(tmp_path / "plain") == ["doc a\n", "doc b\n", *TEXTS, *TEXTS]
    packed = open_corpus(str(tmp_path / "packed")).units(max_unit_bytes=1)
    assert [u.label.rsplit("/", 1)[-1] for u in packed] == [f"a.txt{suffix}", f"b.jsonl{suffix}", f"c.json{suffix}"]


def test_json_lines_in_a_json_file_are_read_a_line_at_a_time(tmp_path, monkeypatch):
    """A "*.json.gz" of JSON lines (a common dump format) streams: it is never read whole."""
    (tmp_path / "dump.json.gz").write_bytes(gzip.compress(_jsonl(ROWS * 3)))
    monkeypatch.setattr(gzip.GzipFile, "read", lambda *a, **k: pytest.fail("read whole"))
    assert _docs(tmp_path / "dump.json.gz") == TEXTS * 3
    (tmp_path / "bad.json").write_bytes(_jsonl(ROWS) + b"{broken\n")
    with pytest.raises(UsageError, match=r"bad\.json:4: not a valid UTF-8 JSON line"):
        _docs(tmp_path / "bad.json")


def test_json_list_single_record_and_lines(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(ROWS, indent=2))
    (tmp_path / "one.json").write_text(json.dumps({"body": "only one"}, indent=2))
    (tmp_path / "lines.json").write_bytes(_jsonl(ROWS))
    assert _docs(tmp_path / "list.json") == TEXTS
    assert _docs(tmp_path / "lines.json") == TEXTS
    assert _docs(tmp_path / "one.json", text_field="body") == ["only one"]


def test_parquet_reads_the_text_column_by_row_groups(tmp_path):
    path = tmp_path / "d.parquet"
    texts = [f"row {i} " + "w" * (i % 7) for i in range(50)]
    table = pa.table({"id": list(range(50)), "body": texts})
    pq.write_table(table, path, row_group_size=8)
    corpus = open_corpus(str(path), text_field="body")
    assert list(corpus.documents()) == texts
    units = corpus.units(max_unit_bytes=1)
    assert len(units) == pq.ParquetFile(path).num_row_groups == 7
    assert units[1].label == f"{path}[row groups 1:2]"
    assert [d for u in units for d in u.documents()] == texts
    assert [u.label for u in corpus.units()] == [str(path)]


def test_missing_text_field_names_file_row_and_keys(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_jsonl([{"text": "x"}, {"body": "y", "id": 1}]))
    with pytest.raises(UsageError, match=r"a\.jsonl:2: no string field 'text' \(keys: body, id\); pass --text_field"):
        _docs(tmp_path / "a.jsonl")
    (tmp_path / "b.json").write_text(json.dumps([{"text": "x"}, {"content": "y"}]))
    with pytest.raises(UsageError, match=r"b\.json \(record 1\): no string field 'text' \(keys: content\)"):
        _docs(tmp_path / "b.json")
    pq.write_table(pa.table({"id": [1], "body": ["z"]}), tmp_path / "c.parquet")
    with pytest.raises(UsageError, match=r"c\.parquet: no column 'text' \(columns: id, body\); pass --text_field"):
        _docs(tmp_path / "c.parquet")
    with pytest.raises(UsageError, match=r"c\.parquet \(row 0\): column 'id' holds int, not text"):
        _docs(tmp_path / "c.parquet", text_field="id")


@pytest.mark.parametrize(
    "name, data, message",
    [
        (
            "a.jsonl.gz",
            b'{"text": "not compressed"}\n',
            r"a\.jsonl\.gz: not a valid gzip file .*; fix or rename it",
        ),
        ("cut.txt.gz", gzip.compress(b"some text " * 50)[:30], r"cut\.txt\.gz: not a valid gzip file .*end-of-stream"),
        (
            "flipped.jsonl.gz",
            (lambda z: z[:20] + bytes(b ^ 0xFF for b in z[20:40]) + z[40:])(gzip.compress(_jsonl(ROWS) * 20)),
            r"flipped\.jsonl\.gz: not a valid gzip file",
        ),
        ("a.txt.zst", b"plain text", r"a\.txt\.zst: not a valid zstd file .*; fix or rename it"),
        ("a.parquet", b"text, not parquet", r"a\.parquet: not a parquet file .*; fix or rename it"),
        ("a.json", b"{not json at all", r"a\.json: not JSON .*; fix the file"),
        ("a.json", b"[1, 2]", r"a\.json \(record 0\): no string field 'text' \(keys: a int, not a record\)"),
    ],
)
def test_content_not_what_the_suffix_says(tmp_path, name, data, message):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(UsageError, match=message) as err:
        _docs(tmp_path / name)
    assert "\n" not in str(err.value)
