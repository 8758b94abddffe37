"""A checksum per file of a saved checkpoint step, recorded when the save completes, checked before a restore.

`record(step_dir)` writes `checksums.json` into the step's folder: for every file in its item folders
(`state/`, `data/`, `meta/`) the size and the CRC-32, read in 1 MiB chunks. `Checkpointer` calls it on
process 0 once every process has written its files and before the folder takes its final name, so a
complete step always carries its record. `first_mismatch(step_dir)` names the first recorded file that is
missing, has another size or another checksum; a step saved before checksums were recorded verifies by
default (there is nothing to compare with).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

FILE = "checksums.json"
ALGORITHM = "crc32"
_CHUNK = 1 << 20


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def _item_files(step_dir: Path) -> list[Path]:
    return sorted(f for item in step_dir.iterdir() if item.is_dir() for f in item.rglob("*") if f.is_file())


def record(step_dir: Path) -> None:
    """Write the step's checksum record (atomically: a killed write leaves no record, not a wrong one)."""
    files = {f.relative_to(step_dir).as_posix(): [f.stat().st_size, crc32(f)] for f in _item_files(step_dir)}
    tmp = step_dir / f".{FILE}.partial"
    tmp.write_text(json.dumps({"algorithm": ALGORITHM, "files": files}))
    os.replace(tmp, step_dir / FILE)


def first_mismatch(step_dir: Path) -> str | None:
    """None when every recorded file matches (or nothing was recorded); else what differs, e.g.
    'state/d/1f2e... does not match the checksum recorded when it was saved'."""
    path = step_dir / FILE
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"its checksum record {FILE} is unreadable"
    for name, (size, value) in files.items():
        f = step_dir / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes but was saved with {size}"
        if crc32(f) != value:
            return f"{name} does not match the checksum recorded when it was saved"
    return None


def newest_verifying(directory: Path, steps: list[int]) -> int | None:
    """The newest of `steps` (step folders in `directory`) whose files all match their record."""
    for step in sorted(steps, reverse=True):
        if first_mismatch(directory / str(step)) is None:
            return step
    return None


__all__ = ["FILE", "record", "first_mismatch", "newest_verifying"]
