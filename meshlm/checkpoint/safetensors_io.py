"""The safetensors file format, read and written without holding a whole file (or a whole model) in memory.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw tensor bytes. Reading: `read_header` lists where each tensor lies (`Entry`), and
`Entry.read_rows` reads rows of one tensor with `readinto` into a fresh buffer (no memory map, whose resident
pages would count against the reader). Slicing for device placement goes through `SliceReader`
(`safetensors.safe_open`, which memory-maps: closed as soon as the slices are read). Writing:
`SafetensorsWriter` fixes the header up front, so tensors can be written in any order at their final
offsets, cast chunk by chunk. A model split over several files carries `model.safetensors.index.json`
(tensor name -> file): `read_index`, `shard_file_names` and `index_json`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from meshlm.errors import UsageError

INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20  # the cast-and-write unit of SafetensorsWriter

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in _DTYPES.items()}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def np_dtype(name: str | np.dtype, flag: str = "--dtype") -> np.dtype:
    """'bfloat16' -> numpy dtype (ml_dtypes for bfloat16); one-line error for anything but a float type."""
    if isinstance(name, np.dtype):
        return name
    if name not in FLOAT_DTYPES:
        raise UsageError(f"{flag}={name}: choose one of {', '.join(FLOAT_DTYPES)}")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a safetensors file."""

    file: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data

    def read_rows(self, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows [r0, r1) of the leading axis, read with `readinto` into one fresh buffer (no memory map)."""
        r1 = self.shape[0] if r1 is None else r1
        row = math.prod(self.shape[1:])
        out = np.empty((r1 - r0) * row, self.dtype)
        view = memoryview(out.view(np.uint8))
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.start + r0 * row * self.dtype.itemsize)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise UsageError(f"{self.file} is truncated (tensor {self.name}); re-download or re-convert it")
                done += n
        return out.reshape((r1 - r0, *self.shape[1:]))


def read_header(path: Path) -> dict[str, Entry]:
    """Name -> Entry for every tensor of a safetensors file; a corrupt header is a UsageError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise UsageError(f"{path} is not a safetensors file (bad header); re-download or re-convert it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"{path} has a corrupt safetensors header; re-download or re-convert it") from None
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        if h["dtype"] not in _DTYPES:
            raise UsageError(f"{path}: tensor {name} has dtype {h['dtype']}, which meshlm cannot read")
        dtype, shape = _DTYPES[h["dtype"]], tuple(h["shape"])
        begin, end = h["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
            raise UsageError(f"{path}: tensor {name} does not fit the file (truncated?); re-download or re-convert it")
        out[name] = Entry(path, name, dtype, shape, 8 + n + begin)
    return out


def read_index(directory: Path) -> list[Path] | None:
    """The shard files `model.safetensors.index.json` lists (each must exist), or None without an index."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except json.JSONDecodeError as e:
        raise UsageError(f"{index} is not valid JSON ({e.msg} at line {e.lineno}); re-download it") from None
    files = sorted({directory / f for f in weight_map.values()})
    if missing := [f.name for f in files if not f.is_file()]:
        raise UsageError(f"{index} lists {missing[0]}, which is missing; download every shard")
    return files


def shard_file_names(n: int) -> list[str]:
    """Hugging Face's names for a model in n safetensors files."""
    return ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def index_json(weight_map: dict[str, str], total_bytes: int) -> str:
    """The text of `model.safetensors.index.json` for this name -> file map."""
    return json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2) + "\n"


class SafetensorsWriter:
    """A safetensors file whose header is fixed up front; tensors (or row blocks of them) are then written
    in any order at their final offsets, cast to the declared dtype chunk by chunk."""

    def __init__(self, path: Path, specs: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": metadata}
        self.where: dict[str, tuple[int, np.dtype, int]] = {}
        offset = 0
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.where[name] = (offset, dtype, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.base = 8 + len(raw)
        self.path = path
        self.written = dict.fromkeys(self.where, 0)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pwrite(struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self.base + offset)

    def _pwrite(self, data, pos: int) -> None:
        view = memoryview(data)
        while len(view):
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n

    def write(self, name: str, array: np.ndarray, start: int = 0) -> None:
        """Write `array` (any layout, any float dtype) as elements [start, start + size) of tensor `name`."""
        offset, dtype, _ = self.where[name]
        array = np.asarray(array)
        if array.ndim == 0:
            array = array.reshape(1)
        pos = self.base + offset + start * dtype.itemsize
        if array.dtype == dtype and array.flags.c_contiguous:  # already laid out: write it as it is
            self._pwrite(array.reshape(-1).view(np.uint8), pos)
            self.written[name] += array.nbytes
            return
        row_bytes = max(1, math.prod(array.shape[1:]) * dtype.itemsize)
        step = max(1, CHUNK_BYTES // row_bytes)
        for r in range(0, array.shape[0], step):
            chunk = array[r : r + step].astype(dtype, order="C").reshape(-1).view(np.uint8)
            self._pwrite(chunk, pos)
            pos += chunk.nbytes
            self.written[name] += chunk.nbytes
            del chunk  # free before the next chunk is allocated: one chunk alive at a time

    def close(self) -> None:
        os.close(self.fd)
        missing = [n for n, (_, _, nbytes) in self.where.items() if self.written[n] != nbytes]
        if missing:
            raise RuntimeError(f"{self.path}: tensors not fully written: {missing[:3]}")


class SliceReader:
    """Open `safe_open` handles, one per file, for reading slices of tensors (they memory-map: `close` them
    once the slices are read)."""

    def __init__(self):
        self._open: dict[Path, Any] = {}

    def slice(self, entry: Entry, index: tuple[slice, ...]) -> np.ndarray:
        from safetensors import safe_open

        if entry.file not in self._open:
            self._open[entry.file] = safe_open(str(entry.file), framework="numpy")
        return self._open[entry.file].get_slice(entry.name)[index]

    def close(self) -> None:
        self._open.clear()


__all__ = [
    "Entry",
    "read_header",
    "read_index",
    "shard_file_names",
    "index_json",
    "SafetensorsWriter",
    "SliceReader",
    "np_dtype",
    "FLOAT_DTYPES",
    "INDEX_FILE",
    "CHUNK_BYTES",
]
