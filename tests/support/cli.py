"""Run `meshlm` in a fresh process (its own simulated devices), and a free loopback port."""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def meshlm(*args, env=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("XLA_FLAGS", None)  # --devices must be what sets the device count
    return subprocess.run(
        [sys.executable, "-m", "meshlm", *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
