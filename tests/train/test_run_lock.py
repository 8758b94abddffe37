"""One run at a time in an --output_dir: a second is refused in one line naming the holder, before it
touches any of the first run's files; the lock dies with its holder."""

import os
import signal
import subprocess
import sys

from meshlm.train.run_lock import LOCK_FILE, run_folder_lock
from tests.support.cli import ROOT

HOLD = (
    "from meshlm.train.run_lock import run_folder_lock\nwith run_folder_lock(__import__('sys').argv[1]):\n"
    "    print('held', flush=True)\n    __import__('time').sleep(300)\n"
)


def hold(out):
    """Another process holding `out`'s lock (as a running `meshlm train` does)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def snapshot(out):
    return {p.relative_to(out): p.read_bytes() if p.is_file() else None for p in sorted(out.rglob("*"))}


def test_a_second_run_is_refused_and_touches_nothing(tmp_path, capsys):
    from meshlm.cli import main

    out = tmp_path / "run"
    in_progress = out / "checkpoints" / "3.orbax-checkpoint-tmp" / "state"
    in_progress.mkdir(parents=True)
    (in_progress / "chunk").write_bytes(b"half-written save")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2}\n')
    holder = hold(out)
    try:
        before = snapshot(out)
        argv = [
            "train",
            "--model=test",
            "--dataset=synthetic",
            "--steps=2",
            "--batch_size=8",
            "--seq_len=32",
            f"--output_dir={out}",
        ]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"pid {holder.pid} on host " in err and "another run" in err, err
        assert str(out) in err and "--output_dir" in err, err
        assert snapshot(out) == before
    finally:
        holder.send_signal(signal.SIGKILL)  # the OS releases the lock of a killed holder
        holder.wait(timeout=30)
    with run_folder_lock(out):
        assert (out / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on host ")


def test_only_process_0_locks(tmp_path):
    out = tmp_path / "run"
    holder = hold(out)
    try:
        with run_folder_lock(out, enabled=False):  # another process of the same multi-process run
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
