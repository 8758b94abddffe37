"""Token shards: a prepared corpus as one folder of `.npy` token streams, one per unit, read back as one stream.

    shards = TokenShards(folder)          # checks every unit's header and size, keeping no file open
    shards[a:b]                           # a numpy array (a copy), read across unit boundaries
    shards.ensure_intact()                # before reading: UsageError if an open unit's file shrank

The files are plain numpy `.npy` memory maps, the token cache's own format: any offset reads without
loading the rest, and nothing beyond numpy is needed. The folder holds `manifest.json` (format, corpus
spec and fingerprint, tokenizer fingerprint, dtype, vocabulary size and per unit: stem, label,
source file, documents, tokens, input bytes, the process that wrote it), and per unit `unit-NNNNN.npy` (each
document's ids followed by the end-of-text id) and `unit-NNNNN.docs.npy` (the int64 end offset of each
document in the unit). Opening reads no ids; each read checks its ids against the vocabulary (a corpus of
any size starts at once, and a damaged file still stops a run in one line). Units are mapped when first
read and at most OPEN_UNITS stay mapped (the least recently read closed first), so a corpus of any number
of units stays within the descriptor limit. `GrowingNpy` writes a stream a chunk at a time.
"""

from __future__ import annotations

import errno
import json
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from meshlm.data.token_cache import DamagedCache, TokenStream, open_token_cache, read_stream_header
from meshlm.errors import UsageError

FORMAT = "shards-v1"  # bump when the folder's layout changes
MANIFEST = "manifest.json"
OPEN_UNITS = 64  # units mapped at once at most (two descriptors each)


class DamagedShard(DamagedCache):
    """A unit's file fails its checks; `stem` names the unit, so that it alone is prepared again."""

    def __init__(self, message: str, stem: str):
        super().__init__(message)
        self.stem = stem


def unit_stem(index: int) -> str:
    """The file stem of unit `index`: unit-00007."""
    return f"unit-{index:05d}"


class GrowingNpy:
    """A one-dimensional `.npy` file written by appending chunks; `close()` writes the final header.

    The header of a 1-D array has the same length whatever its size (numpy pads it to 64 bytes and
    leaves room for the shape to grow), so it is written first for length 0 and rewritten in place."""

    def __init__(self, path: str | os.PathLike, dtype):
        self.path, self.dtype, self.length = Path(path), np.dtype(dtype), 0
        self._file = open(self.path, "wb")
        self._header_len = self._write_header(0)

    def _write_header(self, length: int) -> int:
        self._file.seek(0)
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (length,)}
        np.lib.format.write_array_header_1_0(self._file, header)
        return self._file.tell()

    def append(self, values: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        end = self._file.tell()
        if self._write_header(self.length) != self._header_len:
            raise OSError(f"the .npy header of {self.path} changed length; the stream is not readable")
        self._file.seek(end)
        self._file.close()


class TokenShards:
    """A prepared folder (module docstring) as one read-only 1-D stream of token ids over its units in order:
    `len`, integer and slice indexing (a slice is a numpy array), `dtype`, `ensure_intact()`."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        try:
            self.manifest = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise DamagedCache(f"{self.folder / MANIFEST} cannot be read ({e})") from None
        if self.manifest.get("format") != FORMAT:
            raise DamagedCache(f"{self.folder / MANIFEST} is format {self.manifest.get('format')!r}, not {FORMAT}")
        self.dtype = np.dtype(self.manifest["dtype"])
        self.units: list[dict] = self.manifest["units"]
        for unit in self.units:
            self._check_unit(unit)
        self._ends = np.cumsum([u["tokens"] for u in self.units], dtype=np.int64)
        self._open: OrderedDict[int, TokenStream] = OrderedDict()  # unit -> its stream, least recently read first

    def _path(self, unit: int | dict) -> Path:
        return self.folder / f"{(self.units[unit] if isinstance(unit, int) else unit)['stem']}.npy"

    def _check_unit(self, unit: dict) -> None:
        """DamagedShard if the unit's file is missing or its header and size do not hold its manifest's tokens
        (the file is opened for its header and closed again)."""
        path = self._path(unit)
        try:
            _, length = read_stream_header(path, self.dtype)
        except FileNotFoundError:
            raise DamagedShard(f"{path.name} is missing", unit["stem"]) from None
        except DamagedCache as e:
            raise DamagedShard(f"{path.name} {e}", unit["stem"]) from None
        except OSError as e:
            raise _not_damage(path, e) from None
        if length != unit["tokens"]:
            raise DamagedShard(f"{path.name} holds {length} tokens, the manifest {unit['tokens']}", unit["stem"])

    def _stream(self, unit: int) -> np.ndarray:
        """Unit `unit`'s memory map, opened now if it is not open (closing the least recently read beyond
        OPEN_UNITS)."""
        if unit in self._open:
            self._open.move_to_end(unit)
            return self._open[unit]
        path = self._path(unit)
        try:
            stream = open_token_cache(path, self.dtype, self.manifest["vocab_size"], check_ids=False)
        except DamagedCache as e:
            raise UsageError(
                f"the token shard {path} {e} since this run opened it; run again to prepare it anew"
            ) from None
        except OSError as e:
            raise _not_damage(path, e) from None
        if len(stream) != self.units[unit]["tokens"]:
            raise UsageError(f"the token shard {path} changed since this run opened it; run again to prepare it anew")
        self._open[unit] = stream
        while len(self._open) > max(1, OPEN_UNITS):
            self._open.popitem(last=False)  # its map and descriptors close with their last reference
        return stream

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @property
    def documents(self) -> int:
        """How many documents the stream holds."""
        return sum(u["documents"] for u in self.units)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[start:stop][::step] if start < stop else np.zeros(0, self.dtype)
            return self._read(start, max(start, stop))
        index = int(key)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"token {key} is outside a stream of {len(self)}")
        return self._read(index, index + 1)[0]

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as one array, from as many units as they span."""
        first = int(np.searchsorted(self._ends, start, side="right"))
        pieces = []
        while start < stop and first < len(self.units):
            base = int(self._ends[first - 1]) if first else 0
            end = min(stop, int(self._ends[first]))
            piece = np.array(self._stream(first)[start - base : end - base])  # a copy: holds no map open
            pieces.append(self._checked(first, piece))
            start, first = end, first + 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def _checked(self, unit: int, ids: np.ndarray) -> np.ndarray:
        vocab_size = self.manifest["vocab_size"]
        if ids.size and int(ids.max()) >= vocab_size:
            path = self._path(unit)
            raise UsageError(
                f"the token shard {path} holds id {int(ids.max())}, outside the tokenizer's vocabulary of "
                f"{vocab_size}; delete {self.folder} and run again to prepare it anew"
            )
        return ids

    def __array__(self, dtype=None, copy=None):
        whole = self._read(0, len(self))
        return whole if dtype is None else whole.astype(dtype)

    def ensure_intact(self) -> None:
        """UsageError (one line) if an open unit's file has shrunk since it was mapped (a unit not open is
        checked when a read opens it)."""
        for stream in self._open.values():
            stream.ensure_intact()

    def document_ends(self, unit: int) -> np.ndarray:
        """The end offset of each document in unit `unit` (memory-mapped int64)."""
        return np.load(self.folder / f"{self.units[unit]['stem']}.docs.npy", mmap_mode="r")

    def tokens_per_source(self) -> dict[str, tuple[int, int]]:
        """source (a unit's file, else its label) -> (documents, tokens), summed over its units, in corpus order."""
        out: dict[str, tuple[int, int]] = {}
        for u in self.units:
            source = u.get("source", u["label"])
            docs, tokens = out.get(source, (0, 0))
            out[source] = (docs + u["documents"], tokens + u["tokens"])
        return out

    def __repr__(self) -> str:
        return f"TokenShards({str(self.folder)!r}, units={len(self.units)}, tokens={len(self)})"


def _not_damage(path: Path, error: OSError) -> UsageError:
    """The one-line error for a unit file that cannot be opened for a reason other than damage (nothing
    is deleted): too many open files names the limit to raise."""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        return UsageError(
            f"cannot open the token shard {path}: too many open files ({error.strerror}); raise the limit "
            "(ulimit -n 65536) and run again"
        )
    return UsageError(f"cannot open the token shard {path} ({error}); fix its folder's permissions and run again")


__all__ = ["FORMAT", "MANIFEST", "OPEN_UNITS", "DamagedShard", "GrowingNpy", "TokenShards", "unit_stem"]
