"""Several real processes on one machine: jax.distributed over loopback, gloo collectives on CPU.

Each multi-process run is `meshlm train` in 2 processes × 4 simulated devices; the reference is the
same job in this test process on 8 simulated devices.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshlm import distributed
from meshlm.config import TrainConfig
from meshlm.errors import UsageError
from meshlm.mesh import MeshShape, resolve_hybrid, split_over_hosts
from meshlm.train.loop import train
from tests.support.cli import ROOT, free_port

# A constant learning rate, so a run cut short at step k continues like one that was always longer.
JOB = [
    "--model=test",
    "--dataset=synthetic",
    "--batch_size=8",
    "--seq_len=32",
    "--log_every=1",
    "--lr=1e-2",
    "--warmup_steps=0",
    "--min_lr_ratio=1",
    "--dtype=float32",
    "--peak_tflops=1",
]


def launch(
    n: int, flags: list[str], out: Path, devices_each: int = 4, port: int | None = None, env_each=None
) -> list[subprocess.Popen]:
    """`meshlm train` in n processes; `env_each(pid)`: variables of one process's own."""
    port = port or free_port()
    base = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    base.pop("XLA_FLAGS", None)
    procs = []
    for pid in range(n):
        env = {**base, **(env_each(pid) if env_each else {})}
        cmd = [
            sys.executable,
            "-m",
            "meshlm",
            "train",
            f"--devices={devices_each}",
            *JOB,
            *flags,
            f"--output_dir={out}",
            f"--coordinator_address=127.0.0.1:{port}",
            f"--num_processes={n}",
            f"--process_id={pid}",
        ]
        log = open(out.parent / f"{out.name}.p{pid}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    return procs


def wait_all(procs, out: Path, timeout: float = 600) -> None:
    for pid, p in enumerate(procs):
        rc = p.wait(timeout=timeout)
        assert rc == 0, f"process {pid} exited {rc}:\n" + (out.parent / f"{out.name}.p{pid}.log").read_text()[-3000:]


def losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def single(out, **kw) -> dict[int, float]:
    base = dict(
        model="test",
        dataset="synthetic",
        batch_size=8,
        seq_len=32,
        log_every=1,
        lr=1e-2,
        warmup_steps=0,
        min_lr_ratio=1.0,
        dtype="float32",
        peak_tflops=1.0,
        output_dir=str(out),
    )
    train(TrainConfig(**{**base, **kw}))
    return losses(out)


# ------------------------------------------------------------------------------------------- flags


def test_cluster_from_flags_then_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    assert distributed.resolve(environ=env) == distributed.Cluster("10.0.0.1:1234", 4, 2)
    assert distributed.resolve(process_id=3, environ=env).process_id == 3
    assert not distributed.resolve(environ={}).multi_process
    assert distributed.resolve(environ={"SLURM_JOB_ID": "7"}).auto_detect


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), "--process_id=2 is not in 0 .. 1"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=-1), "--process_id=-1 is not in 0 .. 1"),
        (dict(coordinator_address="h", num_processes=2, process_id=0), "must be HOST:PORT"),
        (dict(num_processes=2, process_id=0), "--coordinator_address is missing"),
        (dict(coordinator_address="h:1", num_processes=2), "--process_id is missing"),
        (dict(coordinator_address="h:1", process_id=0), "--num_processes is missing"),
    ],
)
def test_bad_cluster_flags(kw, words):
    with pytest.raises(UsageError, match=words):
        distributed.resolve(environ={}, **kw)


def test_unreachable_coordinator_is_one_line_exit_2(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshlm",
            "train",
            "--devices=4",
            *JOB,
            f"--output_dir={tmp_path}",
            f"--coordinator_address=127.0.0.1:{free_port()}",
            "--num_processes=2",
            "--process_id=1",
            "--connect_timeout=2",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the coordinator at 127.0.0.1:" in lines[0], r.stderr
    assert time.monotonic() - t0 < 60


def test_hosts_split_over_the_slow_axes_first():
    assert split_over_hosts(MeshShape(2, 2, 2, 1), 2) == MeshShape(2, 1, 1, 1)
    assert split_over_hosts(MeshShape(1, 4, 1, 2), 2) == MeshShape(1, 2, 1, 1)
    assert split_over_hosts(MeshShape(2, 8, 4, 1), 32) == MeshShape(2, 8, 2, 1)
    shape, dcn = resolve_hybrid("1,4,2,1", None, False, "2,1,1,1", 16, 2)
    assert (shape, dcn) == (MeshShape(2, 4, 2, 1), MeshShape(2, 1, 1, 1))
    with pytest.raises(UsageError, match="--dcn_mesh_dim=3,1,1,1"):
        resolve_hybrid("1,4,2,1", None, False, "3,1,1,1", 16, 2)
    with pytest.raises(UsageError, match="cannot be spread over 3 hosts"):
        split_over_hosts(MeshShape(1, 4, 2, 1), 3)


def test_watchdog_names_the_silent_process():
    """A peer whose heartbeat stops changing for longer than the timeout ends this process with one line."""

    class Store:
        def __init__(self):
            self.kv = {}

        def key_value_set(self, k, v, allow_overwrite=False):
            self.kv[k] = v

        def key_value_dir_get(self, prefix):
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    now = [0.0]
    exits = []
    dog = distributed.Watchdog(0, 3, timeout=5, coordinator="h:1", exit=exits.append, clock=lambda: now[0])
    store = Store()
    seen = {k: (None, 0.0) for k in range(3)}
    for t in range(4):  # processes 1 and 2 beat, then 2 falls silent; 1 says it is done
        now[0] = float(t)
        store.key_value_set("meshlm/heartbeat/1", str(t))
        store.key_value_set("meshlm/heartbeat/2", str(t))
        dog.check(store, seen, 0.0)
    store.key_value_set("meshlm/heartbeat/1", "done")
    now[0] = 8.0
    dog.check(store, seen, 0.0)
    assert exits == []
    now[0] = 9.5
    dog.check(store, seen, 0.0)
    assert exits == [1]


def test_a_usage_error_stops_every_process_with_its_line(capsys):
    """Process 1's watchdog reads process 0's usage error from the store and leaves with status 2 and
    that message; process 0 keeps the coordinator up until the others have left (or its grace ends)."""

    class Store(dict):
        def key_value_set(self, k, v, allow_overwrite=False):
            self[k] = v

        def key_value_dir_get(self, prefix):
            return [(k, v) for k, v in self.items() if k.startswith(prefix)]

    store, exits, now = Store(), [], [0.0]
    store["meshlm/heartbeat/0"] = "stopped:--dcn_mesh_dim=4,1,1,1: the axes multiply to 4 but there are 2 hosts"
    dog = distributed.Watchdog(1, 2, timeout=5, coordinator="h:1", exit=exits.append, clock=lambda: now[0])
    dog.check(store, {k: (None, 0.0) for k in range(2)}, 0.0)
    assert exits == [2]
    assert store["meshlm/heartbeat/1"].startswith("stopped:process 0 stopped: --dcn_mesh_dim=4,1,1,1")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: process 1: process 0 stopped: --dcn_mesh_dim=4,1,1,1: the axes multiply to 4 but there are 2 hosts"
    ], err

    ticks = iter(range(100))
    distributed.leave_on_usage_error(0, "bad flag", exits.append, store, 2, grace=50, clock=lambda: next(ticks))
    assert exits == [2, 2] and next(ticks) < 5  # process 1 had left: no wait
    del store["meshlm/heartbeat/1"]
    ticks = iter(range(100))
    distributed.leave_on_usage_error(0, "bad flag", exits.append, store, 2, grace=5, clock=lambda: next(ticks))
    assert exits == [2, 2, 2] and next(ticks) >= 6  # a silent peer: waited out the grace, then left


# ------------------------------------------------------------------------------ real processes


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """1 process × 8 devices, 4 steps, for both meshes: {mesh_dim: run folder}. They also save at step 2,
    the checkpoint that two processes resume in test_checkpoint_moves_between_two_processes_and_one."""
    runs = {m: tmp_path_factory.mktemp("ref") for m in ("2,2,2,1", "1,4,1,2")}
    for m, out in runs.items():
        single(out, mesh_dim=m, steps=4, save_every=2)
    return runs


@pytest.fixture(scope="module")
def reference(single_runs):
    return {m: losses(out) for m, out in single_runs.items()}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """`meshlm train` in 2 processes × 4 devices, 4 steps saving at step 2, once per mesh: {mesh_dim: run folder}."""
    runs = {}

    def get(mesh_dim):
        if mesh_dim not in runs:
            out = tmp_path_factory.mktemp("two") / "run"
            wait_all(launch(2, [f"--mesh_dim={mesh_dim}", "--steps=4", "--save_every=2"], out), out)
            runs[mesh_dim] = out
        return runs[mesh_dim]

    return get


def resume_from_step_2(run: Path, out: Path) -> Path:
    """A fresh run folder holding only `run`'s checkpoint of step 2."""
    shutil.copytree(run / "checkpoints" / "2", out / "checkpoints" / "2")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh_dim", ["2,2,2,1", "1,4,1,2"])
def test_two_processes_match_one(reference, two_process_runs, mesh_dim):
    out = two_process_runs(mesh_dim)
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [reference[mesh_dim][s] for s in range(1, 5)], rtol=1e-5)
    log0 = (out.parent / "run.p0.log").read_text()
    dcn = {"2,2,2,1": "2,1,1,1", "1,4,1,2": "1,2,1,1"}[mesh_dim]  # hosts over dp, else fsdp
    assert "2 processes × 4 devices" in log0 and f"--dcn_mesh_dim={dcn}" in log0
    assert "step" not in (out.parent / "run.p1.log").read_text().lower()  # logs come from process 0 only


@pytest.mark.slow
def test_checkpoint_moves_between_two_processes_and_one(reference, single_runs, two_process_runs, tmp_path):
    """Step 2's checkpoint of a 2-process run resumed by 1 process, and of a 1-process run by 2, continue
    with the losses of the run that never stopped."""
    want = reference["2,2,2,1"]
    # saved by 2 processes, resumed by 1
    out = resume_from_step_2(two_process_runs("2,2,2,1"), tmp_path / "a")
    got = single(out, mesh_dim="2,2,2,1", steps=4)
    assert sorted(got) == [3, 4]  # it did resume at step 3
    np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)], rtol=1e-5)
    # saved by 1, resumed by 2
    out = resume_from_step_2(single_runs["2,2,2,1"], tmp_path / "b")
    wait_all(launch(2, ["--mesh_dim=2,2,2,1", "--steps=4"], out), out)
    got = losses(out)
    assert sorted(got) == [3, 4]
    np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)], rtol=1e-5)


@pytest.mark.slow
def test_hosts_without_a_shared_cache_each_prepare_the_corpus(tmp_path):
    """Processes whose cache folders differ (hosts with their own disks) do not wait for each other's token
    shards: each prepares the whole corpus, and the run goes on."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (i % 50)}) + "\n" for i in range(400)))
    out = tmp_path / "run"
    flags = [f"--dataset={corpus}", "--mesh_dim=2,2,2,1", "--steps=2"]
    procs = launch(2, flags, out, env_each=lambda pid: {"MESHLM_CACHE": str(tmp_path / f"cache{pid}")})
    wait_all(procs, out, timeout=300)
    for pid in range(2):
        assert len(list((tmp_path / f"cache{pid}" / "shards").glob("*/manifest.json"))) == 1
    assert "is not shared by the hosts" in (out.parent / "run.p0.log").read_text()
    assert sorted(losses(out)) == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_dead_process_stops_the_other_with_one_line(tmp_path, victim):
    out = tmp_path / "run"
    procs = launch(2, ["--mesh_dim=2,2,2,1", "--steps=100000", "--peer_timeout=5"], out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    assert (out / "metrics.jsonl").exists(), (tmp_path / "run.p0.log").read_text()[-3000:]
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    survivor = 1 - victim
    rc = procs[survivor].wait(timeout=90)
    elapsed = time.monotonic() - t0
    log = (tmp_path / f"run.p{survivor}.log").read_text()
    assert rc != 0 and elapsed < 60, (rc, elapsed, log[-3000:])
    assert f"error: process {survivor}: " in log, log[-3000:]
    assert (f"process {victim} sent no heartbeat" if victim else "lost the coordinator at 127.0.0.1:") in log


@pytest.mark.slow
def test_a_hybrid_mesh_the_hosts_cannot_fill_is_one_line_in_every_process(tmp_path):
    out = tmp_path / "run"
    procs = launch(2, ["--mesh_dim=1,2,2,1", "--dcn_mesh_dim=4,1,1,1", "--steps=2"], out)
    for pid, p in enumerate(procs):
        assert p.wait(timeout=300) == 2
        lines = [x for x in (tmp_path / f"run.p{pid}.log").read_text().splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and "--dcn_mesh_dim=4,1,1,1: the axes multiply to 4 but there are 2 hosts" in lines[0]
