"""Corpora: where training text comes from, named by the `--dataset` spec string.

Spec forms (docs/data.md, "Inputs", says how each is read):

- ``stdlib`` (default): the Python standard library's own ``*.py`` sources, one document per file.
- ``synthetic``: random tokens for benchmarks; no text at all (see `loader.py`).
- a path: a ``.txt``, ``.jsonl``, ``.json`` or ``.parquet`` file (the first three also ``.gz`` or
  ``.zst`` compressed), a directory (its files of those kinds, recursively) or a glob such as
  ``data/*.jsonl``; `text_field` (``--text_field``) names the JSON key or parquet column.
- ``hf:NAME[:split]``: a Hugging Face dataset, streamed, when ``datasets`` is installed.

Every corpus yields its documents in a deterministic order, splits into work `Unit`s (byte ranges of
big files, groups of small ones, parquet row groups, dataset shards) whose documents, in order, are
the corpus's, and has a cheap `fingerprint` that changes when its contents may have changed.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import meshlm.data.readers as readers
from meshlm.errors import UsageError

STDLIB = "stdlib"
SYNTHETIC = "synthetic"
DEFAULT_DATASET = STDLIB

_SUPPORTED = ".txt, .jsonl, .json (each also .gz or .zst) or .parquet"
DEFAULT_UNIT_BYTES = 256 << 20  # a work unit reads about this much input at most
_READ_FORMAT = "read-v2"  # bump when reading rules change: the fingerprint (and so every cache) follows
_STDLIB_SKIP = frozenset({"test", "tests", "site-packages", "__pycache__"})


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where meshlm caches tokenizers and token ids: `cache_dir`, else `$MESHLM_CACHE`, else
    `~/.cache/meshlm` (or `$XDG_CACHE_HOME/meshlm`)."""
    if cache_dir is None:
        cache_dir = os.environ.get("MESHLM_CACHE") or (
            Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshlm"
        )
    return Path(cache_dir).expanduser()


def atomic_write(path: Path, write) -> None:
    """Call `write(tmp_path)` and move the result onto `path` in one step, so that concurrent
    processes sharing a cache never see a half-written file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise UsageError(f"cannot write the cache file {path} ({e}); set MESHLM_CACHE to a writable folder") from e
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def is_synthetic(spec: str) -> bool:
    """True for the `synthetic` spec, which has no text and needs no tokenizer."""
    return spec.strip().lower() == SYNTHETIC


@dataclass(frozen=True)
class Piece:
    """One stretch of one input: bytes [start, stop) of a .txt/.jsonl file, row groups [start, stop)
    of a parquet file, shard `start` of `stop` shards of a streamed dataset, or (stop -1) a whole file."""

    kind: str  # readers.kind_of's names, or "hf"
    path: str  # the file; for "hf", the dataset name
    start: int = 0
    stop: int = -1
    nbytes: int = 0
    split: str = ""  # "hf" only

    @property
    def label(self) -> str:
        if self.kind == "hf":
            return f"hf:{self.path}:{self.split}" + (f"[shard {self.start}/{self.stop}]" if self.stop > 1 else "")
        if self.stop < 0:
            return self.path
        return f"{self.path}[{'row groups ' if self.kind == 'parquet' else ''}{self.start}:{self.stop}]"

    def documents(self, text_field: str) -> Iterator[str]:
        if self.kind == "hf":
            return readers.hf_documents(self.path, self.split, text_field, self.start, max(self.stop, 1))
        if self.kind == "txt":
            return readers.txt_documents(self.path, self.start, self.stop)
        if self.kind == "jsonl":
            return readers.jsonl_documents(self.path, text_field, self.start, self.stop)
        if self.kind == "json":
            return readers.json_documents(self.path, text_field)
        if self.kind == "parquet":
            return readers.parquet_documents(self.path, text_field, self.start, self.stop)
        return readers.whole_file_documents(self.path)


@dataclass(frozen=True)
class Unit:
    """A piece of work for one worker process: consecutive stretches of the corpus's inputs.
    Plain fields only, so that it pickles; `documents()` reads it."""

    label: str  # e.g. "data/a.jsonl" or "data/big.jsonl[0:268435456]"
    nbytes: int  # the input bytes it reads (compressed size for .gz/.zst; 0 when unknown)
    pieces: tuple[Piece, ...] = ()
    text_field: str = "text"

    def documents(self) -> Iterator[str]:
        """The unit's non-empty documents, in corpus order."""
        for piece in self.pieces:
            yield from piece.documents(self.text_field)


class Corpus:
    """A named, ordered collection of text documents."""

    spec: str

    def documents(self) -> Iterator[str]:
        """Yield every non-empty document, always in the same order."""
        raise NotImplementedError

    def units(self, max_unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[Unit]:
        """The corpus as ordered work units of about `max_unit_bytes` of input at most (a compressed
        file or one parquet row group may be more): their documents, concatenated in order, are
        exactly `documents()`."""
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """A short hash that changes when the corpus contents may have changed."""
        raise NotImplementedError


class FileCorpus(Corpus):
    """Documents read from local files, each by its kind (`readers.kind_of`)."""

    def __init__(self, spec: str, files: list[Path], text_field: str = "text", *, exact_key=False):
        self.spec = spec
        self.files = list(files)
        self.text_field = text_field
        # The stdlib is keyed on relative names and sizes (stable across machines); user files
        # also on their modification time, so that an edited file retokenizes.
        self._exact_key = exact_key

    def documents(self) -> Iterator[str]:
        count = 0
        for path in self.files:
            for doc in Piece(readers.kind_of(str(path)), str(path)).documents(self.text_field):
                count += 1
                yield doc
        if not count:
            raise UsageError(f"dataset {self.spec!r} holds no documents (its files are empty); point at text")

    def units(self, max_unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[Unit]:
        if max_unit_bytes < 1:
            raise UsageError(f"max_unit_bytes must be positive, got {max_unit_bytes}; raise it")
        pieces = [p for path in self.files for p in _file_pieces(str(path), max_unit_bytes)]
        if not any(p.nbytes for p in pieces):
            raise UsageError(f"dataset {self.spec!r} holds no documents (its files are empty); point at text")
        return _pack(pieces, max_unit_bytes, self.text_field)

    @cached_property
    def fingerprint(self) -> str:
        salt = "" if self._exact_key else sys.version  # the stdlib differs between Pythons
        h = hashlib.sha256(f"{_READ_FORMAT}|{self.text_field}|{salt}\n".encode())
        for path in self.files:
            stat = path.stat()
            if self._exact_key:
                h.update(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
            else:
                h.update(f"{path.name}|{stat.st_size}\n".encode())
        return h.hexdigest()[:16]


MAX_DOCUMENT_BYTES = 64 << 20  # a .txt document longer than this (no separator line in it) is refused


def _file_pieces(path: str, max_unit_bytes: int) -> list[Piece]:
    """One file as pieces: byte ranges cut at document starts when it is big and splittable, runs of
    row groups for parquet, else the whole file."""
    kind, size = readers.kind_of(path), os.path.getsize(path)
    if kind == "parquet":
        return _parquet_pieces(path, max_unit_bytes)
    if size <= max_unit_bytes or not readers.splittable(path):
        return [Piece(kind, path, nbytes=size)]
    after = readers.line_start_after if kind == "jsonl" else readers.separator_end_after
    pieces, start = [], 0
    while start < size:
        target = start + max_unit_bytes
        stop = size if target >= size else readers.cut_at_or_before(path, kind, start, target)
        if not stop:  # a document longer than max_unit_bytes: the piece runs to its end
            stop = after(path, target, size)
            if kind == "txt" and stop - start > MAX_DOCUMENT_BYTES:
                raise UsageError(
                    f"{path}: {stop - start:,} bytes from byte {start:,} hold no line with only {readers.SEPARATOR}, "
                    f"one document too long to tokenize in bounded memory; separate its documents with such lines "
                    f"(docs/data.md, Inputs) or give them as .jsonl"
                )
        pieces.append(Piece(kind, path, start, stop, stop - start))
        start = stop
    return pieces


def _parquet_pieces(path: str, max_unit_bytes: int) -> list[Piece]:
    meta = readers.parquet_file(path).metadata
    sizes = [
        sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
        for g in range(meta.num_row_groups)
    ]
    pieces, start = [], 0
    for g in range(len(sizes)):
        if g + 1 == len(sizes) or sum(sizes[start : g + 2]) > max_unit_bytes:
            pieces.append(Piece("parquet", path, start, g + 1, sum(sizes[start : g + 1])))
            start = g + 1
    if len(pieces) == 1:  # the whole file
        return [Piece("parquet", path, 0, -1, pieces[0].nbytes)]
    return pieces or [Piece("parquet", path, 0, 0, 0)]


def _pack(pieces: list[Piece], max_unit_bytes: int, text_field: str) -> list[Unit]:
    """Consecutive pieces grouped into units of at most `max_unit_bytes` (a bigger piece alone)."""
    groups: list[list[Piece]] = []
    total = 0
    for piece in pieces:
        if not groups or total + piece.nbytes > max_unit_bytes:
            groups.append([])
            total = 0
        groups[-1].append(piece)
        total += piece.nbytes
    return [Unit(_group_label(g), sum(p.nbytes for p in g), tuple(g), text_field) for g in groups]


def _group_label(pieces: list[Piece]) -> str:
    if len(pieces) == 1:
        return pieces[0].label
    return f"{pieces[0].label} .. {pieces[-1].label} ({len(pieces)} inputs)"


class HFCorpus(Corpus):
    """A Hugging Face dataset, streamed with the optional `datasets` library (never held whole)."""

    def __init__(self, spec: str, name: str, split: str, text_field: str = "text"):
        self.spec, self.name, self.split, self.text_field = spec, name, split, text_field

    @cached_property
    def _stream(self):
        stream = readers.hf_stream(self.name, self.split)
        columns = getattr(stream, "column_names", None)
        if columns and self.text_field not in columns:
            raise UsageError(
                f"dataset {self.name!r} has no {self.text_field!r} column (columns: "
                f"{', '.join(columns)}); pass --text_field=COLUMN naming one of them"
            )
        return stream

    def documents(self) -> Iterator[str]:
        count = 0
        for unit in self.units():
            for doc in unit.documents():
                count += 1
                yield doc
        if not count:
            raise UsageError(f"dataset {self.spec!r} holds no documents in {self.text_field!r}; check --text_field")

    def units(self, max_unit_bytes: int = DEFAULT_UNIT_BYTES) -> list[Unit]:
        """One unit per shard (a file of the dataset) when it has several, else one."""
        shards = max(int(getattr(self._stream, "num_shards", 1) or 1), 1)
        sizes = [_local_size(f) for f in self._data_files]
        if len(sizes) != shards or not all(s is not None for s in sizes):
            sizes = [_hf_split_bytes(self._stream, self.split) // shards] * shards
        pieces = [Piece("hf", self.name, i, shards, sizes[i] or 0, self.split) for i in range(shards)]
        return [Unit(p.label, p.nbytes, (p,), self.text_field) for p in pieces]

    @cached_property
    def _data_files(self) -> list[str]:
        return readers.hf_data_files(self.name, self.split)

    @cached_property
    def fingerprint(self) -> str:
        """The dataset's data files (a hub dataset's name its revision; local ones with their sizes and
        times) and its card's version and split size."""
        info = getattr(self._stream, "info", None)
        split_info = getattr(info, "splits", None) or {}
        key = f"hf|{_READ_FORMAT}|{self.name}|{self.split}|{self.text_field}|{getattr(info, 'version', '')}"
        key += f"|{split_info.get(self.split, '')}"
        for name in self._data_files:
            stat = os.stat(name) if os.path.exists(name) else None
            key += f"\n{name}" + (f"|{stat.st_size}|{stat.st_mtime_ns}" if stat else "")
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def _local_size(name: str) -> int | None:
    return os.path.getsize(name) if os.path.isfile(name) else None


def _hf_split_bytes(stream, split: str) -> int:
    """The split's size in bytes when the dataset's card says it (0 when unknown)."""
    splits = getattr(getattr(stream, "info", None), "splits", None) or {}
    try:
        return int(getattr(splits.get(split), "num_bytes", 0) or 0)
    except (AttributeError, TypeError, ValueError):
        return 0


def open_corpus(spec: str = DEFAULT_DATASET, text_field: str = "text") -> Corpus:
    """Resolve a dataset spec string to a `Corpus`; raise `UsageError` for anything unusable."""
    spec = spec.strip()
    if is_synthetic(spec):
        raise UsageError("the synthetic dataset has no text corpus; use it only to make a loader")
    if spec.lower() == STDLIB:
        return FileCorpus(STDLIB, stdlib_files(), text_field)
    if spec.startswith("hf:"):
        return _open_hf(spec, text_field)
    return FileCorpus(spec, _local_files(spec), text_field, exact_key=True)


def stdlib_files() -> list[Path]:
    """The standard library's `*.py` files, sorted, without tests and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _STDLIB_SKIP]  # prune while walking
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    if not files:
        raise UsageError(f"no Python sources found under {root}; pass --dataset=PATH instead")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _local_files(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and readers.is_supported(str(p)))
        if not files:
            raise UsageError(f"directory {spec!r} holds no {_SUPPORTED} files; point at a folder of them")
        return files
    if glob.has_magic(spec):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise UsageError(f"glob {spec!r} matched no files; check the pattern")
        supported = [p for p in files if readers.is_supported(str(p))]  # not _SUCCESS, .crc, archives, ...
        if not supported:
            raise UsageError(f"glob {spec!r} matched no {_SUPPORTED} files (first: {files[0]}); check the pattern")
        return supported
    raise UsageError(
        f"unknown dataset {spec!r}: use stdlib, synthetic, hf:NAME[:split], "
        f"or an existing file ({_SUPPORTED}), directory or glob"
    )


def _open_hf(spec: str, text_field: str) -> HFCorpus:
    name, _, split = spec[len("hf:") :].partition(":")
    if not name:
        raise UsageError(f"dataset {spec!r} names no dataset; write hf:NAME[:split]")
    try:
        import datasets  # noqa: F401  (optional dependency, imported only when asked for)
    except ImportError:
        raise UsageError(f"--dataset={spec} needs the Hugging Face `datasets` library: pip install datasets") from None
    return HFCorpus(spec, name, split or "train", text_field)
