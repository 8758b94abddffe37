"""`meshlm plan --verify` over several processes: `jax.distributed` from the cluster flags (as `meshlm
train`), 2 local processes × 4 simulated devices over loopback, the same compiled figures as 1 × 8."""

import json
import os
import subprocess
import sys

import pytest

from meshlm.cli import main
from tests.support.cli import ROOT, free_port

JOB = [
    "plan",
    "--model=test",
    "--batch_size=8",
    "--seq_len=32",
    "--hardware=h100",
    "--dtype=float32",
    "--mesh_dim=pp:2,tp:4",
    "--verify=1",
    "--json",
    "--top=1",
]


@pytest.mark.slow
def test_two_processes_verify_the_same_figures_as_one(capsys, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # each process brings 4 devices (the plan's --devices=8 over 2 processes)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshlm",
                *JOB,
                "--devices=8",
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={pid}",
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    assert main([*JOB, "--devices=8"]) == 0  # meanwhile: this process, 8 devices
    one = json.loads(capsys.readouterr().out)["plans"][0]
    outs = [p.communicate(timeout=240) for p in procs]
    for pid, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {pid}: {err[-3000:]}"
    assert outs[1][0] == ""  # process 0 prints
    two = json.loads(outs[0][0])["plans"][0]
    assert two["compiled"]["compiled_for"] == "8 simulated CPU devices (2 processes)"
    for key in (
        "memory_bytes_per_device",
        "collective_bytes_per_device_per_step",
        "stage_transfer_bytes_per_device_per_step",
    ):
        assert two["compiled"][key] == one["compiled"][key], key
    assert two["error_percent"] == one["error_percent"]


def test_cluster_flags_are_checked_like_train(capsys):
    rc = main([*JOB, "--devices=8", "--num_processes=2", "--process_id=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--coordinator_address is missing" in err[0]
