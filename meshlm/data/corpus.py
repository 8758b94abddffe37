"""Corpora: where training text comes from, named by the `--dataset` spec string.

Spec forms:

- ``stdlib`` (default): the Python standard library's own ``*.py`` sources. No download, and the
  same on every machine with the same Python, which makes it a good smoke-test corpus.
- ``synthetic``: random tokens for benchmarks; no text at all (see `loader.py`).
- a path: a ``.txt`` file (one document per file), a ``.jsonl`` file (one document per line, its
  ``text`` field, or whichever field `text_field`, the ``--text_field`` flag, names; chat records,
  with a ``messages`` list, are read by `meshlm.data.chat`), a directory (its ``.txt``/``.jsonl``
  files, recursively) or a glob such as ``data/*.jsonl``.
- ``hf:NAME[:split]``: a Hugging Face dataset, when the optional ``datasets`` library is installed.

Every corpus yields its documents in a deterministic order and has a `fingerprint` that changes
when its contents may have changed; the caches in `tokenizer.py` and `loader.py` are keyed on it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

from meshlm.errors import UsageError

STDLIB = "stdlib"
SYNTHETIC = "synthetic"
DEFAULT_DATASET = STDLIB

_TEXT_SUFFIXES = (".txt", ".jsonl")
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


class Corpus:
    """A named, ordered collection of text documents."""

    spec: str

    def documents(self) -> Iterator[str]:
        """Yield every non-empty document, always in the same order."""
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """A short hash that changes when the corpus contents may have changed."""
        raise NotImplementedError


class FileCorpus(Corpus):
    """Documents read from local files: `.jsonl` gives one document per line, anything else one
    document per file."""

    def __init__(self, spec: str, files: list[Path], text_field: str = "text", *, exact_key=False):
        self.spec = spec
        self.files = list(files)
        self.text_field = text_field
        # The stdlib is keyed on relative names and sizes (stable across machines); user files
        # also on their modification time, so that an edited file retokenizes.
        self._exact_key = exact_key

    def documents(self) -> Iterator[str]:
        for path in self.files:
            if path.suffix == ".jsonl":
                yield from _jsonl_documents(path, self.text_field)
            else:
                text = _read_text(path)
                if text.strip():
                    yield text

    @cached_property
    def fingerprint(self) -> str:
        salt = "" if self._exact_key else sys.version  # the stdlib differs between Pythons
        h = hashlib.sha256(f"{self.text_field}|{salt}\n".encode())
        for path in self.files:
            stat = path.stat()
            if self._exact_key:
                h.update(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
            else:
                h.update(f"{path.name}|{stat.st_size}\n".encode())
        return h.hexdigest()[:16]


class HFCorpus(Corpus):
    """A Hugging Face dataset, loaded with the optional `datasets` library."""

    def __init__(self, spec: str, name: str, split: str, text_field: str = "text"):
        self.spec, self.name, self.split, self.text_field = spec, name, split, text_field

    @cached_property
    def _dataset(self):
        import datasets  # checked importable by open_corpus

        try:
            ds = datasets.load_dataset(self.name, split=self.split)
        except Exception as e:  # network, unknown name, unknown split, ...
            raise UsageError(
                f"could not load Hugging Face dataset {self.name!r} split {self.split!r}: {e}; "
                f"check the name with --dataset=hf:NAME[:split]"
            ) from e
        if self.text_field not in ds.column_names:
            raise UsageError(
                f"dataset {self.name!r} has no {self.text_field!r} column (columns: "
                f"{', '.join(ds.column_names)}); pass --text_field=COLUMN naming one of them"
            )
        return ds

    def documents(self) -> Iterator[str]:
        for text in self._dataset[self.text_field]:
            if isinstance(text, str) and text.strip():
                yield text

    @cached_property
    def fingerprint(self) -> str:
        version = getattr(self._dataset, "_fingerprint", "")
        key = f"hf|{self.name}|{self.split}|{self.text_field}|{version}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


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
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if not files:
            raise UsageError(f"directory {spec!r} holds no .txt or .jsonl files; point at one")
        return files
    if glob.has_magic(spec):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise UsageError(f"glob {spec!r} matched no files; check the pattern")
        return files
    raise UsageError(
        f"unknown dataset {spec!r}: use stdlib, synthetic, hf:NAME[:split], "
        f"or an existing .txt/.jsonl file, directory or glob"
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


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}; check the path and permissions") from e


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        handle = path.open("rb")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}; check the path and permissions") from e
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise UsageError(f"{path}:{lineno}: not a valid UTF-8 JSON line ({e}); fix or remove it") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if text is None and isinstance(record, dict) and isinstance(record.get("messages"), list):
                # chat data (meshlm.data.chat): its messages' text, e.g. to train a tokenizer on
                text = "\n".join(
                    m["content"]
                    for m in record["messages"]
                    if isinstance(m, dict) and isinstance(m.get("content"), str)
                )
            if not isinstance(text, str):
                raise UsageError(
                    f"{path}:{lineno}: no string field {text_field!r}; pass --text_field=KEY naming "
                    f"the field that holds the text (or give chat data a \"messages\" list)"
                )
            if text.strip():
                yield text
