"""`meshlm plan` from the command line: the table, --json, --verify, --png, and one-line errors (exit 2)."""

import json
import math

import pytest

from meshlm.cli import main

JOB = ["plan", "--model=test", "--devices=8", "--batch_size=8", "--seq_len=32"]


def plan(capsys, *flags):
    rc = main([*JOB, *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_table_ranks_meshes_and_prints_the_train_command(capsys):
    rc, out, err = plan(capsys, "--hardware=h100", "--top=5")
    assert rc == 0 and err == ""
    for header in ("mesh_dim", "memory", "step s", "tokens/s", "MFU", "comm-bound", "operator", "intensity"):
        assert header in out
    assert "best 5" in out
    line = next(l for l in out.splitlines() if l.startswith("recommended: "))
    assert line.startswith("recommended: meshlm train --model=test --mesh_dim=")
    assert "--batch_size=8 --seq_len=32" in line


def test_json_has_predictions_per_plan(capsys):
    rc, out, _ = plan(capsys, "--hardware=tpu-v5e", "--json")
    doc = json.loads(out)
    assert rc == 0
    assert doc["hardware"]["name"] == "tpu-v5e" and doc["hardware"]["source"]
    assert doc["recommended"] == doc["plans"][0]["command"]
    first = doc["plans"][0]
    predicted = first["predicted"]
    pie = predicted["memory_bytes_per_device"]
    assert pie["total"] == sum(pie[k] for k in ("params", "gradients", "optimizer", "activations", "temporaries"))
    for key in ("collective_bytes_per_device_per_step", "step_seconds", "tokens_per_second", "mfu"):
        assert key in predicted
    assert predicted["tokens_per_second"] == pytest.approx(8 * 32 / predicted["step_seconds"])
    assert {op["name"] for op in first["operators"]} >= {"attn.qkv", "attention", "mlp.in", "mlp.down", "lm_head"}
    assert "compiled" not in first and "error_percent" not in first
    assert [p["rank"] for p in doc["plans"]] == list(range(1, len(doc["plans"]) + 1))


@pytest.mark.slow
def test_verify_adds_compiled_figures_and_errors(capsys):
    rc, out, _ = plan(capsys, "--hardware=h100", "--dtype=float32", "--verify=2", "--json")
    doc = json.loads(out)
    assert rc == 0
    for rank, p in enumerate(doc["plans"]):
        if rank >= 2:
            assert "compiled" not in p
            continue
        compiled, err = p["compiled"], p["error_percent"]
        assert compiled["compiled_for"] == "8 simulated CPU devices"
        predicted = p["predicted"]["memory_bytes_per_device"]["total"]
        got = compiled["memory_bytes_per_device"]
        assert got > 0 and err["memory_bytes_per_device"] == pytest.approx(100 * (predicted - got) / got)
        coll = compiled["collective_bytes_per_device_per_step"]["total"]
        pred_coll = p["predicted"]["collective_bytes_per_device_per_step"]["total"]
        assert err["collective_bytes_per_device_per_step"] == pytest.approx(100 * (pred_coll - coll) / coll)
        assert math.isfinite(err["memory_bytes_per_device"])


@pytest.mark.parametrize(
    "flags,devices,per_host",
    [(["--hosts=4"], 32, 8), (["--hosts=2", "--devices_per_host=4"], 8, 4), (["--hosts=2", "--devices=32"], 32, 16)],
)
def test_hosts_times_devices_per_host(capsys, flags, devices, per_host):
    rc = main(["plan", "--model=test", "--batch_size=32", "--seq_len=32", "--hardware=h100", "--json", *flags])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["job"]["devices"] == devices
    assert doc["hardware"]["fast_domain_devices"] == per_host  # NVLink stops at the server


def test_png_chart(capsys, tmp_path):
    path = tmp_path / "charts" / "plan.png"
    rc, out, _ = plan(capsys, "--hardware=a100", f"--png={path}")
    assert rc == 0 and f"chart: {path}" in out
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


IMPOSSIBLE = [
    # nothing fits: the nearest change that does
    # (the budget is what JAX takes: 75% of the a100's 80 GB)
    (["--model=llama2-70b", "--hardware=a100"], "nothing fits in 60.0 GB per a100", "nearest change that fits: --"),
    # the batch is below dp × fsdp for every mesh (tiny has 4 heads, an odd sequence rules out sp)
    (
        ["--model=tiny", "--devices=16", "--batch_size=1", "--seq_len=255"],
        "no mesh of 16 devices",
        "raise --batch_size to a multiple of 4",
    ),
    (["--hardware=tpu-v9"], "--hardware=tpu-v9: unknown hardware", "choose one of h100"),
    (["--bogus=1"], "unrecognized arguments: --bogus=1", "meshlm plan --help"),
    (["--batch_size=0"], "--batch_size=0", "must be a positive integer"),
    (["--verify=-1"], "--verify=-1", "must be ≥ 0"),
    # the job's own checks: meshlm train's words (meshlm.job, tests/test_job.py)
    (["--remat=sometimes"], "--remat='sometimes'", "choose one of"),
    (["--dtype=int8"], "--dtype=int8", "choose auto, float32, bfloat16 or float16"),
    (["--batch_size=6", "--grad_accum=4"], "not divisible by --grad_accum=4", "--grad_accum"),
    (
        ["--mesh_dim=1,1,1,8", "--seq_len=100"],
        "--mesh_dim=1,1,1,8: seq_len 100",
        "meshes that work on these 8 devices: --mesh_dim=",
    ),
    (
        ["--hosts=2", "--devices_per_host=4", "--devices=16"],
        "--devices=16 but --hosts × --devices_per_host = 8",
        "make them agree",
    ),
    (
        ["--mesh_dim=pp:2,fsdp:4"],
        "--mesh_dim=1,4,1,1 --pp=2: --batch_size=8 does not split into --microbatches=4",
        "meshes that work: --mesh_dim=",
    ),
    (["--hosts=3", "--devices=16"], "--devices=16 is not divisible by --hosts=3", "a multiple of 3"),
    (["--hosts=2", "--hardware=cpu"], "--hosts=2 on --hardware=cpu", "needs --devices_per_host"),
]


@pytest.mark.parametrize(
    "flags,what,fix", IMPOSSIBLE, ids=[f[0][0].split("=")[0] + str(i) for i, f in enumerate(IMPOSSIBLE)]
)
def test_impossible_requests_get_one_line_naming_the_fix(capsys, flags, what, fix):
    rc = main(["plan", "--model=test", *flags] if not any(f.startswith("--model") for f in flags) else ["plan", *flags])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert what in lines[0] and fix in lines[0]
