"""The token cache: one packed stream of token ids in a `.npy` file, memory-mapped when read back.

    tokens = open_token_cache(path, np.uint16, vocab_size)   # raises DamagedCache(why) if the file is not one
    tokens.ensure_intact()                                    # before reading rows: UsageError if the file shrank

A cache is checked when opened: its `.npy` header (magic, version, a one-dimensional stream of the expected
dtype), its size against the header's (a truncated file would map pages past its end, and reading them
kills the process with SIGBUS), and every id below the vocabulary size (random bytes give ids the model's
embedding does not have), read a chunk at a time so memory stays bounded whatever the stream's length.
A file that fails is rebuilt by its caller (`meshlm.data.loader.tokenize_corpus`).

A file truncated while a run has it mapped cannot be checked once and for all; the stream keeps the file
open and `ensure_intact` compares its size with the mapped size (one `fstat`), so a reader stops with one
line before it touches a missing page.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np

from meshlm.errors import UsageError

ID_CHECK_CHUNK = 1 << 24  # ids per chunk of the vocabulary check: 32 MiB of uint16, 64 MiB of uint32


class DamagedCache(Exception):
    """The file is not a token cache this run can use; the message says why (after the file's name)."""


class _FileGuard:
    """An open descriptor of the mapped file and the size it was mapped at."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def check(self) -> None:
        now = os.fstat(self.fd).st_size
        if now < self.size:
            raise UsageError(
                f"the token cache {self.path} shrank from {self.size:,} to {now:,} bytes while this "
                "run was reading it; run again and it is rebuilt"
            )


class TokenStream(np.ndarray):
    """A memory-mapped token stream (a plain array to every reader) that can check that its file is whole."""

    _guard: _FileGuard | None = None

    def __array_finalize__(self, obj):
        self._guard = getattr(obj, "_guard", None)

    def ensure_intact(self) -> None:
        """UsageError (one line) if the file has shrunk since it was opened."""
        if self._guard is not None:
            self._guard.check()


def read_stream_header(path: str | os.PathLike, dtype) -> tuple[int, int]:
    """(offset of the ids, their count) of the `.npy` stream `path`, its header read and its size checked
    against it; DamagedCache if it is not a one-dimensional stream of `dtype` ids that fills the file
    exactly. Keeps no descriptor open."""
    path, want = Path(path), np.dtype(dtype)
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read_header is None:
                raise ValueError(f"version {version}")
            shape, fortran, got = read_header(f)
        except (ValueError, SyntaxError, OSError) as e:
            raise DamagedCache(f"has no readable .npy header ({e})") from None
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
    if got != want or len(shape) != 1 or fortran:
        raise DamagedCache(f"holds a {got} array of shape {shape}, not a stream of {want} ids")
    expected = offset + shape[0] * want.itemsize
    if size != expected:
        raise DamagedCache(f"is {size:,} bytes and its header says {expected:,}")
    return offset, int(shape[0])


def open_token_cache(path: str | os.PathLike, dtype, vocab_size: int, *, check_ids: bool = True) -> TokenStream:
    """The checked stream of `path` (module docstring), memory-mapped read-only; DamagedCache if it is not
    a one-dimensional stream of `dtype` ids below `vocab_size` that fills the file exactly. `check_ids=False`
    leaves the ids to the reader (one pass over a large corpus at every start costs more than its reads)."""
    path, want = Path(path), np.dtype(dtype)
    offset, length = read_stream_header(path, want)
    shape, size = (length,), offset + length * want.itemsize
    if shape[0] == 0:
        return np.zeros(0, want).view(TokenStream)
    tokens = np.memmap(path, dtype=want, mode="r", offset=offset, shape=shape).view(TokenStream)
    tokens._guard = _FileGuard(path, size)
    for start in range(0, shape[0] if check_ids else 0, ID_CHECK_CHUNK):
        top = int(tokens[start : start + ID_CHECK_CHUNK].max())
        if top >= vocab_size:
            raise DamagedCache(f"holds id {top}, outside the tokenizer's vocabulary of {vocab_size}")
    return tokens


__all__ = ["DamagedCache", "TokenStream", "open_token_cache", "read_stream_header", "ID_CHECK_CHUNK"]
