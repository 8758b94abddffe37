"""Readers of corpus inputs: each turns one stretch of one input into its non-empty documents.

A stretch is a byte range of an uncompressed `.txt`/`.jsonl` file (cut at document starts:
`line_start_after`, `separator_end_after`), a run of a parquet file's row groups, a shard of a
streamed Hugging Face dataset, or a whole file. `.gz` and `.zst` files are read as streams.
Content that is not what its name says raises one `UsageError` line naming the file and the fix.
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshlm.errors import UsageError

SEPARATOR = "<|endoftext|>"  # a line holding only this splits a .txt file into documents
COMPRESSIONS = (".gz", ".zst")
KINDS = {".txt": "txt", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
_SEPARATOR_BYTES = SEPARATOR.encode()
_SCAN_BYTES = 1 << 20
_SEPARATOR_SLACK = 256  # a separator line with trailing blanks is at most this long to be found backwards
_PARQUET_BATCH_ROWS = 1024


def compression(path: str) -> str:
    """The compression suffix of `path` ('.gz', '.zst') or ''."""
    suffix = Path(path).suffix.lower()
    return suffix if suffix in COMPRESSIONS else ""


def kind_of(path: str) -> str:
    """How `path` is read: 'txt', 'jsonl', 'json', 'parquet' (by its suffix under any compression), or
    'file' (one document: whatever else a user names explicitly)."""
    name = Path(path)
    if compression(path):
        name = name.with_suffix("")
    return KINDS.get(name.suffix.lower(), "file")


def is_supported(path: str) -> bool:
    """True for the suffixes a folder or glob is read for (compressed parquet is not one)."""
    kind = kind_of(path)
    return kind != "file" and not (kind == "parquet" and compression(path))


def splittable(path: str) -> bool:
    """True when `path` can be cut into byte ranges: an uncompressed .txt or .jsonl file."""
    return kind_of(path) in ("txt", "jsonl") and not compression(path)


@contextmanager
def open_input(path: str):
    """`path` opened for binary reading, decompressed on the fly; errors become `UsageError` lines."""
    comp = compression(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115  (closed below)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}; check the path and permissions") from e
    try:
        if comp == ".gz":
            stream: io.BufferedIOBase = gzip.GzipFile(fileobj=handle, mode="rb")
        elif comp == ".zst":
            stream = io.BufferedReader(_zstd().ZstdDecompressor().stream_reader(handle))
        else:
            stream = handle
        yield stream
    except (OSError, EOFError, zlib.error) as e:
        if comp == ".gz":
            raise UsageError(f"{path}: not a valid gzip file ({e}); fix or rename it") from None
        raise UsageError(f"cannot read {path}: {e}; check the path and permissions") from None
    except Exception as e:
        if comp == ".zst" and type(e).__name__ == "ZstdError":
            raise UsageError(f"{path}: not a valid zstd file ({e}); fix or rename it") from None
        raise
    finally:
        handle.close()


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise UsageError("reading .zst files needs the `zstandard` library: pip install 'meshlm[data]'") from None
    return zstandard


def line_start_after(path: str, offset: int, size: int) -> int:
    """The first line start at or after byte `offset` of an uncompressed file (`size` when none)."""
    if offset <= 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        while True:
            chunk = f.read(_SCAN_BYTES)
            if not chunk:
                return size
            at = chunk.find(b"\n")
            if at >= 0:
                return min(f.tell() - len(chunk) + at + 1, size)


def separator_end_after(path: str, offset: int, size: int) -> int:
    """Where the document after the first separator line at or after byte `offset` starts (`size` when
    none): the byte after that separator line."""
    pos = line_start_after(path, offset, size)
    with open(path, "rb") as f:
        f.seek(pos)
        for raw in f:
            pos += len(raw)
            if _is_separator(raw):
                return pos
    return size


def cut_at_or_before(path: str, kind: str, start: int, target: int) -> int | None:
    """The last document start in (start, target] of an uncompressed .jsonl (a line start) or .txt
    file (the byte after a separator line), found reading backwards; None when there is none."""
    with open(path, "rb") as f:
        hi = target
        while hi > start:
            lo = max(start, hi - _SCAN_BYTES)
            f.seek(lo)
            chunk = f.read(hi - lo)
            found = chunk.rfind(b"\n") if kind == "jsonl" else _last_separator_end(chunk, lo == start)
            if found >= 0:
                return lo + found + 1
            hi = lo + min(_SEPARATOR_SLACK, hi - lo - 1) if lo > start else start  # overlap a split line
    return None


def _last_separator_end(chunk: bytes, starts_a_line: bool) -> int:
    """The index of the newline ending the last whole separator line in `chunk`, or -1."""
    end = len(chunk)
    while (at := chunk.rfind(_SEPARATOR_BYTES, 0, end)) >= 0:
        end = at
        newline = chunk.find(b"\n", at)
        line_start = at == 0 and starts_a_line or at > 0 and chunk[at - 1 : at] == b"\n"
        if line_start and newline >= 0 and _is_separator(chunk[at : newline + 1]):
            return newline
    return -1


def _is_separator(raw: bytes) -> bool:
    return raw.startswith(_SEPARATOR_BYTES) and not raw[len(_SEPARATOR_BYTES) :].strip()


def _lines(stream: io.BufferedIOBase, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of the lines starting in [start, stop) (stop -1: to the end)."""
    if start:
        stream.seek(start)
    pos = start
    if stop < 0:
        for raw in stream:
            yield pos, raw
            pos += len(raw)
        return
    for raw in stream:
        if pos >= stop:
            return
        yield pos, raw
        pos += len(raw)


def txt_documents(path: str, start: int = 0, stop: int = -1) -> Iterator[str]:
    """A .txt file's documents: the text between lines holding only `SEPARATOR` (the whole file
    when it has none)."""
    with open_input(path) as stream:
        lines: list[bytes] = []
        for _, raw in _lines(stream, start, stop):
            if _is_separator(raw):
                yield from _non_empty(b"".join(lines))
                lines = []
            else:
                lines.append(raw)
        yield from _non_empty(b"".join(lines))


def whole_file_documents(path: str) -> Iterator[str]:
    """Any other file named explicitly: its whole text, one document."""
    with open_input(path) as stream:
        yield from _non_empty(stream.read())


def _non_empty(data: bytes) -> Iterator[str]:
    text = data.decode("utf-8", errors="replace")
    if text.strip():
        yield text


def jsonl_documents(path: str, text_field: str, start: int = 0, stop: int = -1) -> Iterator[str]:
    """A .jsonl file's documents: each line's `text_field` (blank lines skipped)."""
    with open_input(path) as stream:
        for lineno, (offset, raw) in enumerate(_lines(stream, start, stop), start=1):
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                if not raw.strip():
                    continue
                where = _line_where(path, lineno, start, offset)
                raise UsageError(f"{where}: not a valid UTF-8 JSON line ({e}); fix or remove it") from None
            text = record.get(text_field) if type(record) is dict else None
            if type(text) is not str:
                text = record_text(record, text_field, _line_where(path, lineno, start, offset))
            if text and not text.isspace():
                yield text


def _line_where(path: str, lineno: int, start: int, offset: int) -> str:
    """A line named for an error: its number when read from the file start, else its byte offset."""
    return f"{path}:{lineno}" if start == 0 else f"{path} (the line at byte {offset})"


def json_documents(path: str, text_field: str) -> Iterator[str]:
    """A .json file's documents: a list of records (read whole), one record, or records one per line (read
    a line at a time, as .jsonl: many "*.json" dumps are JSON lines)."""
    with open_input(path) as stream:
        first = stream.readline()
        while first and not first.strip():
            first = stream.readline()
        if first.lstrip()[:1] == b"{" and _one_record(first):
            yield from _non_empty_text(record_text(json.loads(first), text_field, f"{path} (record 0)"))
            for lineno, raw in enumerate(stream, start=2):
                if raw.strip():
                    yield from _json_line_text(path, lineno, raw, text_field)
            return
        data = first + stream.read()
    try:
        records = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 JSON ({e}); fix the file") from None
    except json.JSONDecodeError as e:
        records = _json_lines(path, data, e)
    if isinstance(records, dict):
        records = [records]
    if not isinstance(records, list):
        raise UsageError(f"{path}: a .json file must hold a list of records or one record per line; fix the file")
    for i, record in enumerate(records):
        yield from _non_empty_text(record_text(record, text_field, f"{path} (record {i})"))


def _one_record(line: bytes) -> bool:
    """Whether a line is a whole JSON object by itself (a JSON-lines file), not the start of a longer one."""
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def _json_line_text(path: str, lineno: int, raw: bytes, text_field: str) -> Iterator[str]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}:{lineno}: not a valid UTF-8 JSON line ({e}); fix or remove it") from None
    yield from _non_empty_text(record_text(record, text_field, f"{path}:{lineno}"))


def _json_lines(path: str, data: bytes, error: json.JSONDecodeError) -> list:
    """Records one per line, when a .json file is not one JSON document."""
    records = []
    for lineno, raw in enumerate(data.splitlines(), start=1):
        if raw.strip():
            try:
                records.append(json.loads(raw))
            except json.JSONDecodeError:
                where = f"{path}" if lineno == 1 else f"{path}:{lineno}"
                raise UsageError(f"{where}: not JSON ({error}); fix the file or name it for what it holds") from None
    return records


def record_text(record, text_field: str, where: str) -> str:
    """A JSON record's text: its `text_field`, else (chat data) its messages' contents joined."""
    text = record.get(text_field) if isinstance(record, dict) else None
    if text is None and isinstance(record, dict) and isinstance(record.get("messages"), list):
        # chat data (meshlm.data.chat): its messages' text, e.g. to train a tokenizer on
        text = "\n".join(
            m["content"] for m in record["messages"] if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    if not isinstance(text, str):
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else f"a {type(record).__name__}, not a record"
        raise UsageError(
            f"{where}: no string field {text_field!r} (keys: {keys or 'none'}); pass --text_field=KEY naming "
            f"the field that holds the text (or give chat data a \"messages\" list)"
        )
    return text


def _non_empty_text(text: str) -> Iterator[str]:
    if text.strip():
        yield text


def parquet_file(path: str):
    """`pyarrow.parquet.ParquetFile` of `path` (its metadata read, no rows)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("reading .parquet files needs `pyarrow`: pip install 'meshlm[data]'") from None
    try:
        return pq.ParquetFile(path)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}; check the path and permissions") from None
    except Exception as e:  # pyarrow.ArrowInvalid and friends: not a parquet file
        raise UsageError(f"{path}: not a parquet file ({e}); fix or rename it") from None


def parquet_documents(path: str, text_field: str, start: int = 0, stop: int = -1) -> Iterator[str]:
    """Row groups [start, stop) of a parquet file: its `text_field` column, a batch of rows at a time."""
    pf = parquet_file(path)
    names = pf.schema_arrow.names
    if text_field not in names:
        raise UsageError(
            f"{path}: no column {text_field!r} (columns: {', '.join(names)}); pass --text_field=COLUMN naming one"
        )
    groups = list(range(start, pf.num_row_groups if stop < 0 else stop))
    row = sum(pf.metadata.row_group(g).num_rows for g in range(start))
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise UsageError(
                    f"{path} (row {row}): column {text_field!r} holds {type(text).__name__}, not text; "
                    f"pass --text_field=COLUMN naming a text column"
                )
            row += 1
            if text:
                yield from _non_empty_text(text)


def hf_stream(name: str, split: str):
    """The streamed (`streaming=True`: never held whole) Hugging Face dataset `name`'s `split`."""
    import datasets  # checked importable by open_corpus

    try:
        return datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # network, unknown name, unknown split, ...
        raise UsageError(
            f"could not load Hugging Face dataset {name!r} split {split!r}: {e}; "
            f"check the name with --dataset=hf:NAME[:split]"
        ) from e


def hf_data_files(name: str, split: str) -> list[str]:
    """The files behind a dataset's split, as `datasets` resolves them (a hub file's name holds the
    revision), or [] when it does not say."""
    import datasets

    try:
        files = datasets.load_dataset_builder(name).config.data_files or {}
        return [str(f) for f in files.get(split, [])]
    except Exception:  # a scripted or unusual dataset: its card's version keys it instead
        return []


def hf_documents(name: str, split: str, text_field: str, shard: int = 0, num_shards: int = 1) -> Iterator[str]:
    """Shard `shard` of `num_shards` (contiguous: the shards in order are the dataset in order)."""
    stream = hf_stream(name, split)
    if num_shards > 1:
        stream = stream.shard(num_shards=num_shards, index=shard, contiguous=True)
    for row, record in enumerate(stream):
        where = f"dataset {name!r} split {split!r} (shard {shard}, row {row})"
        if text_field not in record:
            raise UsageError(
                f"{where}: no column {text_field!r} (columns: {', '.join(record)}); "
                f"pass --text_field=COLUMN naming one of them"
            )
        text = record[text_field]
        if isinstance(text, str):
            yield from _non_empty_text(text)
