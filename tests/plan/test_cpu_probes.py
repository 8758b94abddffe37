"""The CPU's measured costs beyond peak and bandwidth: a rendezvous per collective, and matmuls with few
rows per device below the peak; the step-time model charges both, and only where they were measured."""

from dataclasses import replace

import pytest

from meshlm.mesh import MeshShape
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import PRESETS
from meshlm.plan import cost, estimate, search
from meshlm.plan.hardware import CATALOG, collective_latency_probe, matmul_rows_probe
from meshlm.plan.job import Job

JOB = Job(PRESETS["test"], 8, 32, 8, policy=RunPolicy(dtype="float32"))


def test_matmul_efficiency_interpolates_in_log_rows_and_holds_flat_outside():
    hw = replace(CATALOG["h100"], matmul_rows=((64, 0.5), (256, 0.9)))
    assert hw.matmul_efficiency(32) == 0.5
    assert hw.matmul_efficiency(64) == 0.5
    assert hw.matmul_efficiency(128) == pytest.approx(0.7)  # halfway in log2 between 64 and 256
    assert hw.matmul_efficiency(4096) == 0.9
    assert CATALOG["a100"].matmul_efficiency(1) == 1.0  # nothing measured: the peak
    assert CATALOG["h100"].matmul_efficiency(1) == CATALOG["h200"].matmul_efficiency(8192) == 0.712  # Hopper


def test_probes_measure_simulated_devices():
    latency, over = collective_latency_probe(8, chain=4, repeats=3)
    assert over == 8 and 0 < latency < 0.05
    assert collective_latency_probe(1) == (0.0, 1)
    rows = matmul_rows_probe(8, "float32", peak=1e18, rows=(16, 256), width=128, repeats=2)
    assert [r for r, _ in rows] == [16, 256]
    assert all(0 < e < 1e-3 for _, e in rows)  # a real rate against an unreachable peak


def test_step_time_charges_latency_per_collective_and_row_efficiency_per_matmul():
    shape = MeshShape(1, 4, 2, 1)
    base = replace(CATALOG["h100"], name="cpu", matmul_rows=(), attention_efficiency=1.0)  # CPU-like: nothing overlaps
    plain = search.evaluate(JOB, shape, base)
    slow = search.evaluate(JOB, shape, replace(base, collective_latency=1e-3))
    count = sum(c.count for c in plain.collectives)
    assert count > 0
    assert slow.time.comm_s - plain.time.comm_s == pytest.approx(count * 1e-3)
    assert slow.time.step_s - plain.time.step_s == pytest.approx(count * 1e-3)

    half = search.evaluate(JOB, shape, replace(base, matmul_rows=((1, 0.5),)))
    by_name = {op.name: op for op in plain.operators}
    for op in half.operators:
        factor = 2.0 if op.name in cost.ROW_MATMULS else 1.0
        assert op.compute_s == pytest.approx(by_name[op.name].compute_s * factor), op.name
    assert half.time.step_s > plain.time.step_s

    slow_attention = search.evaluate(JOB, shape, replace(base, attention_efficiency=0.25))
    for op in slow_attention.operators:
        factor = 4.0 if op.name == "attention" else 1.0
        assert op.compute_s == pytest.approx(by_name[op.name].compute_s * factor), op.name


def test_fewer_rows_per_device_cost_more_where_the_probe_says_so():
    """Same FLOPs per device, fewer rows: with a measured fall-off the mesh that splits rows more is slower."""
    hw = replace(CATALOG["h100"], name="cpu", matmul_rows=((64, 0.5), (512, 1.0)))
    rows_split = estimate.operators(JOB, MeshShape(1, 8, 1, 1), hw, [])  # 32 tokens per device
    cols_split = estimate.operators(JOB, MeshShape(1, 2, 4, 1), hw, [])  # 128 tokens per device
    mlp = {name: {op.name: op for op in ops}["mlp.in"] for name, ops in (("rows", rows_split), ("cols", cols_split))}
    assert mlp["rows"].flops == pytest.approx(mlp["cols"].flops)
    assert mlp["rows"].compute_s > mlp["cols"].compute_s


def test_more_devices_than_the_process_has_are_probed_on_those_it_has_and_said_so(monkeypatch):
    from meshlm import flops
    from meshlm.plan import hardware

    monkeypatch.setattr(flops, "matmul_probe", lambda *a, **k: 80e9)
    hw = hardware.cpu_hardware(16, "float32")  # the tests' process has 8 simulated devices
    assert "over 8 devices (the 8 of the 16 this process has)" in hw.source
    assert hw.collective_latency > 0 and hw.ring_step_s >= 0 and len(hw.matmul_rows) == 5
