"""Token shards: a prepared corpus as one folder of `.npy` token streams, one per unit, read back as one stream.

    shards = TokenShards(folder)          # checks every unit's header and size (`meshlm.data.token_cache`)
    shards[a:b]                           # a numpy array, read across unit boundaries
    shards.ensure_intact()                # before reading: UsageError if a file shrank under its map

The files are plain numpy `.npy` memory maps, the token cache's own format: any offset reads without
loading the rest, and nothing beyond numpy is needed. The folder holds `manifest.json` (format, corpus
spec and fingerprint, tokenizer fingerprint, dtype, vocabulary size and per unit: stem, label,
source file, documents, tokens, input bytes, the process that wrote it), and per unit `unit-NNNNN.npy` (each
document's ids followed by the end-of-text id) and `unit-NNNNN.docs.npy` (the int64 end offset of each
document in the unit). Opening reads no ids; each read checks its ids against the vocabulary (a corpus of
any size starts at once, and a damaged file still stops a run in one line). `GrowingNpy` writes a stream a
chunk at a time and fixes its header at the end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from meshlm.data.token_cache import DamagedCache, open_token_cache
from meshlm.errors import UsageError

FORMAT = "shards-v1"  # bump when the folder's layout changes
MANIFEST = "manifest.json"


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
        self._streams = [self._open_unit(u) for u in self.units]
        self._ends = np.cumsum([len(s) for s in self._streams], dtype=np.int64)

    def _open_unit(self, unit: dict):
        path = self.folder / f"{unit['stem']}.npy"
        try:
            stream = open_token_cache(path, self.dtype, self.manifest["vocab_size"], check_ids=False)
        except (DamagedCache, OSError) as e:
            raise DamagedShard(f"{path.name} {e}", unit["stem"]) from None
        if len(stream) != unit["tokens"]:
            raise DamagedShard(f"{path.name} holds {len(stream)} tokens, the manifest {unit['tokens']}", unit["stem"])
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
        while start < stop and first < len(self._streams):
            base = int(self._ends[first - 1]) if first else 0
            end = min(stop, int(self._ends[first]))
            pieces.append(self._checked(first, np.asarray(self._streams[first][start - base : end - base])))
            start, first = end, first + 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def _checked(self, unit: int, ids: np.ndarray) -> np.ndarray:
        vocab_size = self.manifest["vocab_size"]
        if ids.size and int(ids.max()) >= vocab_size:
            path = self.folder / f"{self.units[unit]['stem']}.npy"
            raise UsageError(
                f"the token shard {path} holds id {int(ids.max())}, outside the tokenizer's vocabulary of "
                f"{vocab_size}; delete {self.folder} and run again to prepare it anew"
            )
        return ids

    def __array__(self, dtype=None, copy=None):
        whole = self._read(0, len(self))
        return whole if dtype is None else whole.astype(dtype)

    def ensure_intact(self) -> None:
        """UsageError (one line) if a unit's file has shrunk since it was opened."""
        for stream in self._streams:
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


__all__ = ["FORMAT", "MANIFEST", "DamagedShard", "GrowingNpy", "TokenShards", "unit_stem"]
