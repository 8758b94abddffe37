"""A job that cannot fit is refused before compiling, in one line naming what fits; `meshlm plan
--hardware=cpu` calls a job fitting exactly when train accepts it, and both choose the same
`--remat=auto`; the unrolled GPU layer loop's memory."""

import dataclasses

import pytest

from meshlm import job as joblib
from meshlm.cli import main
from meshlm.config import TrainConfig
from meshlm.errors import UsageError
from meshlm.mesh import MeshShape
from meshlm.plan import fit, hardware, memory, remat, search
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job


def _cpu_hardware(n_devices: int) -> Hardware:
    """`meshlm plan --hardware=cpu`'s hardware without its probes (fixed speeds, the host's memory)."""
    return Hardware(
        "cpu",
        1e11,
        1e11,
        hardware.host_memory_budget() / n_devices,
        1e10,
        1e10,
        1e10,
        fast_domain=n_devices,
        devices_per_host=n_devices,
        fast_name="memory",
        slow_name="memory",
    )


@pytest.fixture
def small_host(monkeypatch):
    """A host with 400 MB to spare for 8 simulated devices (50 MB each)."""
    monkeypatch.setattr(hardware, "host_memory_budget", lambda: 400e6)
    monkeypatch.delenv(joblib.MEMORY_CHECK, raising=False)


def test_a_job_that_cannot_fit_is_refused_in_one_line_before_anything_compiles(
    small_host, monkeypatch, capsys, tmp_path
):
    from meshlm import data

    def read_data(*args, **kwargs):
        raise AssertionError("the memory check comes before the tokenizer, the data and the compile")

    monkeypatch.setattr(data, "load_tokenizer", read_data)
    code = main(["train", "--model=small", "--mesh_dim=1,8,1,1", "--steps=1", f"--output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "GB per device" in err and "nearest change that fits: --" in err and "MESHLM_MEMORY_CHECK=0" in err


def resolved(cfg: TrainConfig, backend: str | None = None):
    """(the model, its run policy) of a train config, as the job resolves them."""
    return joblib.resolve_model(cfg)[0], joblib.resolve_policy(cfg, backend)


def test_the_named_change_fits_and_a_tiny_job_passes(small_host):
    shape = MeshShape(1, 8, 1, 1)
    cfg = TrainConfig(model="small", mesh_dim="1,8,1,1", remat="none")
    with pytest.raises(UsageError) as refused:
        joblib.check_memory(cfg, *resolved(cfg), shape)
    flag, value = str(refused.value).split("nearest change that fits: --")[1].split()[0].split("=")
    changed = dataclasses.replace(cfg, **{flag: type(getattr(cfg, flag))(value)})
    joblib.check_memory(changed, *resolved(changed), shape)  # accepted
    tiny = TrainConfig(model="tiny", mesh_dim="1,8,1,1")
    joblib.check_memory(tiny, *resolved(tiny), shape)


def test_the_escape_runs_it_anyway(small_host, monkeypatch):
    cfg = TrainConfig(model="small", mesh_dim="1,8,1,1")
    model, policy = resolved(cfg)
    with pytest.raises(UsageError):
        joblib.check_memory(cfg, model, policy, MeshShape(1, 8, 1, 1))
    monkeypatch.setenv(joblib.MEMORY_CHECK, "0")
    joblib.check_memory(cfg, model, policy, MeshShape(1, 8, 1, 1))


@pytest.mark.parametrize("preset, budget", [("test", None), ("tiny", None), ("small", None), ("tiny", 8 * 30e6)])
def test_what_plan_says_fits_on_cpu_is_what_train_accepts(preset, budget, monkeypatch):
    """Every mesh of 8 simulated devices of a 24 GiB host (and of a host with 240 MB to spare): plan's
    `fits` is train's check, and plan's `--remat=auto` is train's."""
    monkeypatch.setattr(hardware, "host_memory_bytes", lambda: 24 * 2**30)  # this project's test machine
    if budget:
        monkeypatch.setattr(hardware, "host_memory_budget", lambda: budget)
    monkeypatch.delenv(joblib.MEMORY_CHECK, raising=False)
    cfg = TrainConfig(model=preset, batch_size=8, seq_len=128)
    model, policy = resolved(cfg, backend="cpu")
    job, hw = Job(model, 8, 128, 8, policy=policy), _cpu_hardware(8)
    shapes, _ = search.candidate_shapes(job)
    verdicts = set()
    for shape in shapes:
        plan = search.best_on(job, shape, hw)
        assert plan.job.policy.remat == joblib.auto_remat(cfg, model, policy, shape)  # one choice of policy
        planned = policy.replace(remat=plan.job.policy.remat)
        try:
            joblib.check_memory(
                TrainConfig(model=preset, batch_size=8, seq_len=128, remat=planned.remat), model, planned, shape
            )
            accepted = True
        except UsageError:
            accepted = False
        assert accepted == plan.fits, shape
        verdicts.add(accepted)
    assert True in verdicts and (budget is None or False in verdicts)


def test_cpu_plan_never_asks_for_more_simulated_devices():
    cfg = TrainConfig(model="1b", batch_size=8, seq_len=256)
    model, policy = resolved(cfg, backend="cpu")
    job = Job(model, 8, 256, 8, policy=policy)
    hw = Hardware("cpu", 1e11, 1e11, 2e9 / 8, 1e10, 1e10, 1e10, fast_domain=8, devices_per_host=8)
    with pytest.raises(UsageError) as nothing:
        search.search(job, hw)
    assert "--devices=" not in str(nothing.value) and "nearest change that fits: --model=" in str(nothing.value)


def test_the_host_keeps_memory_for_the_operating_system(monkeypatch):
    monkeypatch.setattr(hardware, "host_memory_bytes", lambda: 24 * 2**30)
    assert 18 * 2**30 < hardware.host_memory_budget() < 21 * 2**30


# --------------------------------------------------------------------------- the unrolled layer loop on GPU


class _GPU:
    platform, device_kind = "gpu", "NVIDIA H200"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


H100_BUDGET_ON_H200 = 0.42 * 141e9  # XLA_PYTHON_CLIENT_MEM_FRACTION=0.42


def _llama_layers(n_layers: int, scan_unroll: int = 0):
    cfg = TrainConfig(
        model="llama3-8b",
        batch_size=1,
        seq_len=8192,
        model_overrides={"n_layers": n_layers, "scan_unroll": scan_unroll},
    )
    return cfg, *resolved(cfg, backend="accelerator")


def test_unrolled_gpu_loop_keeps_every_activation_where_it_fits():
    """8 llama3-8b layers at 8192 tokens: measured 52.0 GB on an H200 with the loop unrolled (65.9 GB
    scanned); `none` fits an H100's budget and is the fastest."""
    cfg, model, policy = _llama_layers(8)
    shape = MeshShape()
    job = joblib.plan_job(cfg, model, policy.replace(remat="none"), shape)
    unrolled = memory.estimate(job, shape, "gpu").total
    assert 50e9 < unrolled < 56e9
    scanned_cfg, scanned_model, scanned_policy = _llama_layers(8, scan_unroll=1)
    scanned = memory.estimate(
        joblib.plan_job(scanned_cfg, scanned_model, scanned_policy.replace(remat="none"), shape), shape, "gpu"
    ).total
    assert scanned > 60e9  # the scanned loop keeps its stacked buffers
    assert joblib.auto_remat(cfg, model, policy, shape, _GPU(H100_BUDGET_ON_H200)) == "none"


def test_a_gpu_job_that_does_not_fit_still_recomputes():
    cfg, model, policy = _llama_layers(10)  # none: 64 GB predicted; save_dots: 55 GB
    shape = MeshShape()
    chosen = joblib.auto_remat(cfg, model, policy, shape, _GPU(H100_BUDGET_ON_H200))
    assert chosen != "none"
    job = joblib.plan_job(cfg, model, policy.replace(remat=chosen), shape)
    assert fit.within(memory.estimate(job, shape, "gpu").total, H100_BUDGET_ON_H200)
    assert not fit.within(memory.estimate(remat.with_remat(job, "none"), shape, "gpu").total, H100_BUDGET_ON_H200)


def test_serving_that_cannot_fit_is_refused_naming_a_shorter_context(small_host):
    from meshlm.models.presets import resolve_model

    with pytest.raises(UsageError, match="serving needs about .* nearest change that fits: --max_seq_len="):
        joblib.resolve_serving(resolve_model("tiny", {}), mesh_dim="1,2,4,1", max_batch=256, build=False)
    joblib.resolve_serving(resolve_model("tiny", {}), mesh_dim="1,2,4,1", build=False)
    with pytest.raises(UsageError, match="use a smaller model"):
        joblib.resolve_serving(resolve_model("1b", {}), mesh_dim="1,1,8,1", build=False)


def test_serving_cache_counts_a_local_layers_window_only():
    """A local layer's KV cache is a ring of its window: Gemma 2's alternation needs half the cache plus
    the windows at a long context."""
    from meshlm.mesh import MeshShape
    from meshlm.models.presets import resolve_model
    from meshlm.plan.fit import serving_bytes

    glob = resolve_model("test", {"n_layers": "4"})
    local = glob.replace(sliding_window=64, layer_pattern="LG")
    shape = MeshShape(1, 1, 1, 1)
    _, full = serving_bytes(glob, "bfloat16", shape, max_batch=2, context=4096)
    _, ring = serving_bytes(local, "bfloat16", shape, max_batch=2, context=4096)
    assert ring == pytest.approx(full * (2 * 4096 + 2 * 64) / (4 * 4096))
