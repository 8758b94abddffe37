"""A plan for simulated CPU devices: its command runs as pasted (--devices), its MFU peak is the one
`meshlm train` measures (and says so), and its chart shows the memory bars and keeps legends off them."""

import json

import pytest

from meshlm.cli import main
from meshlm.models.policy import RunPolicy

JOB = ["plan", "--model=test", "--devices=8", "--batch_size=8", "--seq_len=32", "--hardware=cpu", "--json"]


@pytest.fixture
def fixed_probe(monkeypatch):
    """Both peaks from one fake probe that records how it was asked; the plan's other CPU probes
    (tested in test_cpu_probes.py) give fixed figures."""
    from meshlm import flops
    from meshlm.plan import hardware
    from meshlm.train import metrics

    monkeypatch.setattr(hardware, "collective_latency_probe", lambda n: (1e-4, n))
    monkeypatch.setattr(hardware, "matmul_rows_probe", lambda n, dtype, peak: ((64, 0.6), (1024, 0.9)))
    monkeypatch.setattr(hardware, "ring_step_probe", lambda n, latency: 1e-3)

    calls = []

    def probe(dtype="float32", size=1024, seconds=1.0, device=None):
        calls.append((dtype, size, seconds))
        return 80e9

    monkeypatch.setattr(flops, "matmul_probe", probe)  # what plan calls
    monkeypatch.setattr(metrics, "matmul_probe", probe)  # what train calls
    return calls


def test_cpu_command_names_the_devices(capsys, fixed_probe):
    assert main(JOB) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "--devices=8" in doc["recommended"].split()
    assert all("--devices=8" in p["command"].split() for p in doc["plans"])


def test_cpu_peak_is_trains_mfu_peak(capsys, fixed_probe):
    import jax

    from meshlm.train.metrics import resolve_peak

    assert main(JOB) == 0
    doc = json.loads(capsys.readouterr().out)
    plan_calls = list(fixed_probe)
    from meshlm.platform import resolve_dtype

    train_peak, _ = resolve_peak(None, resolve_dtype("auto", "cpu"))  # the dtype both take by default
    assert plan_calls[-1] == fixed_probe[-1]  # the same dtype, matrix size and duration
    assert doc["hardware"]["peak_flops_per_second"] == train_peak == 80e9 / jax.local_device_count()
    assert "as meshlm train measures" in doc["hardware"]["peak_source"]


def test_peak_tflops_pins_plan_and_train(capsys, fixed_probe):
    assert main([*JOB, "--peak_tflops=0.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["hardware"]["peak_flops_per_second"] == 0.5e12
    assert "--peak_tflops=0.5" in doc["recommended"].split()


def test_table_says_which_peak(capsys, fixed_probe):
    assert main(JOB[:-1]) == 0
    out = capsys.readouterr().out
    from meshlm.platform import resolve_dtype

    assert f"MFU peak: 0.01 TFLOP/s per device (measured {resolve_dtype('auto', 'cpu')} 1024^2 matmul" in out


def test_chart_shows_the_bars_and_keeps_legends_off_them(fixed_probe, tmp_path):
    from meshlm.models.presets import PRESETS
    from meshlm.plan import report, search
    from meshlm.plan.hardware import resolve_hardware
    from meshlm.plan.job import Job, PipelineFlags

    hw = resolve_hardware("cpu", 8, "float32")
    job = Job(PRESETS["test"], 8, 32, 8, 1, PipelineFlags("1f1b", None, 1), RunPolicy(dtype="float32"))
    plans, _ = search.search(job, hw, None, (1,))
    fig = report.figure(job, hw, plans, 5)
    mem, step = fig.axes[:2]
    tallest = max(p.memory.total for p in plans[:5]) / 1e9
    assert mem.get_ylim()[1] < 2 * tallest  # the bars fill the panel, the device memory is a note
    renderer = fig.canvas.get_renderer()
    for ax in (mem, step):
        legend = ax.get_legend().get_window_extent(renderer)
        assert not legend.overlaps(ax.get_window_extent(renderer))
    assert report.write_png(tmp_path / "p.png", job, hw, plans, 5).read_bytes()[:4] == b"\x89PNG"


def test_cpu_plan_says_what_its_probes_measured(capsys, fixed_probe):
    assert main(JOB) == 0
    source = json.loads(capsys.readouterr().out)["hardware"]["source"]
    assert "100 µs per collective and 1.00 ms per ring step over 8 devices" in source
