"""Checkpoints survive interruptions and mesh changes: exact resume, reshard on restore, SIGKILL mid-save."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from meshlm.checkpoint.manager import Checkpointer
from meshlm.errors import UsageError
from meshlm.train.loop import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def config(out, **kw):
    base = dict(
        model="test",
        dataset="synthetic",
        steps=STEPS,
        batch_size=8,
        seq_len=32,
        log_every=1,
        lr=1e-2,
        output_dir=str(out),
        peak_tflops=1.0,
        dtype="float32",
        mesh_dim="1,8,1,1",
    )
    return TrainConfig(**{**base, **kw})


def losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def interrupt_after(out, n_steps):
    """SIGTERM this process once the run has logged n_steps steps (the loop saves and returns)."""

    def watch():
        path = Path(out) / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= n_steps:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(config(out))
    return out, losses(out)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A run on the uninterrupted run's mesh stopped by SIGTERM after its second step: its folder, which
    each test below copies and resumes in its own way."""
    out = tmp_path_factory.mktemp("interrupted")
    interrupt_after(out, 2).join(timeout=0)
    first = train(config(out))
    assert first["interrupted"] == "SIGTERM" and first["checkpoint_step"] < STEPS
    assert Checkpointer(out / "checkpoints").latest_step() == first["checkpoint_step"]
    return out


def resumable(interrupted, tmp_path):
    import shutil

    return shutil.copytree(interrupted, tmp_path / "run")


def test_resume_is_bit_identical(uninterrupted, interrupted, tmp_path):
    _, want = uninterrupted
    out = resumable(interrupted, tmp_path)
    second = train(config(out))
    assert second["interrupted"] is None
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]  # bit-identical


def test_restore_onto_a_different_mesh(uninterrupted, interrupted, tmp_path):
    _, want = uninterrupted
    out = resumable(interrupted, tmp_path)
    train(config(out, mesh_dim="2,1,4,1"))  # resumes and reshards straight into the new layout
    got = losses(out)
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)], [want[s] for s in range(1, STEPS + 1)], rtol=1e-5)


def test_mismatched_checkpoint_is_one_clear_error(uninterrupted):
    out, _ = uninterrupted
    with pytest.raises(UsageError) as err:
        train(config(out, model_overrides={"d_model": "128"}, steps=STEPS + 1))
    assert str(out) in str(err.value) and "d_model=64" in str(err.value)


def test_truncated_checkpoint_is_one_clear_error(uninterrupted, tmp_path):
    import shutil

    out, _ = uninterrupted
    shutil.copytree(out / "checkpoints", tmp_path / "checkpoints")
    step_dir = tmp_path / "checkpoints" / str(STEPS)
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "manifest" not in f.name and f.suffix != ".json":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(UsageError) as err:
        train(config(tmp_path, steps=STEPS + 1))
    assert str(step_dir) in str(err.value)


@pytest.mark.slow
def test_sigkill_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    """Kill -9 a real training process while it saves every step; the next run restores a complete one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    cmd = [
        sys.executable,
        "-m",
        "meshlm",
        "train",
        "--devices=8",
        "--model=tiny",
        "--dataset=synthetic",
        "--steps=200",
        "--batch_size=8",
        "--seq_len=32",
        "--save_every=1",
        "--keep=2",
        "--log_every=1",
        "--peak_tflops=1",
        f"--output_dir={tmp_path}",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    ckpts = tmp_path / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and len([p for p in ckpts.glob("*") if p.name.isdigit()]) < 2:
        time.sleep(0.1)
    time.sleep(0.37)  # saves run back to back: this lands inside one
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    latest = Checkpointer(ckpts).latest_step()
    assert latest is not None and latest >= 1
    result = subprocess.run(
        cmd[:-4] + ["--steps", str(latest + 1), "--log_every=1", "--peak_tflops=1", f"--output_dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resumed from {ckpts / str(latest)}" in result.stdout.replace("\n", "")


def test_resume_with_another_clip_norm(interrupted, tmp_path):
    """The stop message's advice, a --clip_norm other than the run's, is one a run can follow."""
    out = resumable(interrupted, tmp_path)
    stopped_at = Checkpointer(out / "checkpoints").latest_step()
    second = train(config(out, clip_norm=0.0))
    assert second["first_step"] == stopped_at + 1 and second["last_step"] == STEPS
