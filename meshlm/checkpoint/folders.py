"""What every model folder meshlm writes shares: config.json, the files carried along, atomic creation.

Tokenizer files and generation_config.json travel with the weights: into P/tokenizer/ (what
`--tokenizer=P/tokenizer` reads) and P/ of a meshlm params folder, back beside config.json in a Hugging Face
folder. A folder is written into a hidden sibling and renamed onto its path when complete (`Staging`), so a
failed or interrupted write leaves nothing half-written behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from meshlm.errors import UsageError

CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
)
GENERATION_CONFIG = "generation_config.json"


def carried_files(*folders: Path | None) -> tuple[Path, ...]:
    """The tokenizer files and generation config in these folders (the first one found of each name)."""
    found: dict[str, Path] = {}
    for folder in folders:
        for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
            if folder is not None and name not in found and (folder / name).is_file():
                found[name] = folder / name
    return tuple(found.values())


def copy_carried(files: tuple[Path, ...], tokenizer_dst: Path, other_dst: Path) -> None:
    """Tokenizer files into `tokenizer_dst`, the rest into `other_dst`."""
    for f in files:
        dst = tokenizer_dst if f.name in TOKENIZER_FILES else other_dst
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / f.name)


def check_writable_folder(path: str | Path, flag: str) -> None:
    """`path` is a folder meshlm may create or write into: not a file, not under a file, and its nearest
    existing folder writable. One UsageError line naming the fix, before any work."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag}={path} is a file, not a folder; pass a folder path (it is created if missing)")
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(
            f"{flag}={path} lies under {parent}, which is a file; pass a folder path that is not inside a file"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}={path}: {parent} is not writable; pass a folder you can write to")


def check_out(out: Path, flag: str) -> None:
    """The folder to write must be new or empty (and can be created)."""
    check_writable_folder(out, flag)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{flag}={out} already exists and is not empty; choose a new path or delete it")


class Staging:
    """Write into a hidden sibling folder, rename onto `out` when complete: no half-written output."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.parent / f".{out.name}.partial-{os.getpid()}"

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            if self.out.exists():
                self.out.rmdir()  # check_out made sure it is empty
            os.replace(self.tmp, self.out)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


__all__ = [
    "CONFIG_FILE",
    "TOKENIZER_DIR",
    "TOKENIZER_FILES",
    "GENERATION_CONFIG",
    "carried_files",
    "copy_carried",
    "check_writable_folder",
    "check_out",
    "Staging",
]
