"""One run at a time in an --output_dir: an exclusive `fcntl.flock` on OUTPUT_DIR/run.lock, taken before
anything reads or writes the folder and held until the run ends.

The operating system releases the lock when its holder exits, however it exits (a SIGKILL too), so a
stale lock is never left behind. The file holds the holder's pid and host, which a refused run names.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path

from meshlm.checkpoint.folders import check_writable_folder
from meshlm.errors import UsageError

LOCK_FILE = "run.lock"


@contextlib.contextmanager
def run_folder_lock(output_dir: str | Path, enabled: bool = True):
    """Hold the run folder's lock for the block (`enabled` False: take none, as every process of a
    multi-process run but process 0 does). A folder another process holds is one UsageError line
    naming that process."""
    if not enabled:
        yield
        return
    out = Path(output_dir).expanduser()
    check_writable_folder(out, "--output_dir")
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process that is starting"
            raise UsageError(
                f"--output_dir={output_dir} is in use by another run ({holder}); wait for it to end, "
                "or pass another --output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


__all__ = ["LOCK_FILE", "run_folder_lock"]
