"""`--remat=auto`: plan searches the policy (and more gradient accumulation) per mesh and recommends a
runnable command; train takes the least recomputation that fits the device (none on CPU)."""

import json
import time

import pytest

from meshlm.cli import main
from meshlm.config import TrainConfig
from meshlm.job import auto_remat, resolve_model, resolve_policy
from meshlm.mesh import MeshShape
from meshlm.plan import estimate, hardware, remat, search
from meshlm.plan.hardware import resolve_hardware
from meshlm.plan.job import Job

BIG = ["plan", "--model=llama2-70b", "--devices=256", "--hardware=h100", "--batch_size=512", "--seq_len=4096", "--json"]


def _plan(capsys, *flags):
    assert main(list(flags)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "flags",
    [
        BIG,
        [
            "plan",
            "--model=llama3-8b",
            "--devices=64",
            "--hardware=h100",
            "--batch_size=256",
            "--seq_len=8192",
            "--json",
        ],
    ],
)
def test_jobs_that_need_remat_get_a_runnable_command_without_naming_it(capsys, flags):
    doc = _plan(capsys, *flags)
    best = doc["plans"][0]
    assert best["fits"] and best["remat"] in remat.POLICIES
    command = doc["recommended"].split()
    assert f"--remat={best['remat']}" in command and "--remat=auto" not in command
    assert (f"--grad_accum={best['grad_accum']}" in command) == (best["grad_accum"] > 1)


def test_naming_a_policy_keeps_it_and_explains_what_would_fit(capsys):
    assert main([*BIG[:-1], "--remat=none"]) == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "--remat=full" in err


def test_search_takes_the_fastest_policy_that_fits_on_each_mesh():
    cfg = TrainConfig(model="llama3-8b", batch_size=64, seq_len=8192)
    model, policy = resolve_model(cfg)[0], resolve_policy(cfg, backend="accelerator")
    job = Job(model, 64, 8192, 64, policy=policy)
    hw = resolve_hardware("h100", 64)
    shape = MeshShape(1, 64, 1, 1)
    best = search.best_on(job, shape, hw)
    every = [search.evaluate(remat.with_remat(job, p), shape, hw) for p in remat.POLICIES]
    fitting = [p for p in every if p.fits]
    assert fitting and best.fits
    assert best.time.step_s == min(p.time.step_s for p in fitting)
    assert best.job.policy.remat in [p.job.policy.remat for p in fitting]


def test_more_micro_batches_when_no_policy_fits_at_one():
    cfg = TrainConfig(model="llama2-70b", batch_size=512, seq_len=4096)
    model, policy = resolve_model(cfg)[0], resolve_policy(cfg, backend="accelerator")
    job = Job(model, 512, 4096, 64, policy=policy)
    shape = MeshShape(1, 64, 1, 1)
    budget = resolve_hardware("h100", 64).hbm_bytes * (1 - search.HEADROOM)
    one = estimate.memory_pie(remat.with_remat(job, "full"), shape).total
    assert one > budget  # full remat at 8 rows per device does not fit ...
    plan = search.best_on(job, shape, resolve_hardware("h100", 64))
    assert plan.fits and plan.job.grad_accum > 1  # ... a few micro-batches do
    assert estimate.memory_pie(plan.job, shape).total <= budget


def test_first_fitting_is_the_least_recomputation_under_the_budget():
    cfg = TrainConfig(model="llama3-8b", batch_size=8, seq_len=8192)
    model, policy = resolve_model(cfg)[0], resolve_policy(cfg, backend="accelerator")
    job, shape = Job(model, 8, 8192, 8, policy=policy), MeshShape(1, 8, 1, 1)
    peaks = {p: estimate.memory_pie(remat.with_remat(job, p), shape).total for p in remat.POLICIES}
    assert peaks["none"] > peaks["full"]
    for policy in remat.POLICIES:
        budget = peaks[policy] + 1
        chosen, peak = remat.first_fitting(job, shape, budget)
        assert peak <= budget and all(peaks[p] > budget for p in remat.POLICIES[: remat.POLICIES.index(chosen)])
    assert remat.first_fitting(job, shape, 1.0)[0] == "full"


class _Device:
    def __init__(self, platform, limit):
        self.platform, self.limit = platform, limit
        self.device_kind = "fake accelerator"

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_train_auto_on_cpu_keeps_everything_while_the_scratch_stays_in_one_kept_block(monkeypatch):
    """A step whose scratch (every activation kept) stays in one block glibc keeps between steps keeps
    everything; a larger one recomputes the MLP, as does any job where the allocator was left alone."""
    from meshlm import platform

    cpu = _Device("cpu", None)
    small = TrainConfig(model="tiny", batch_size=8, seq_len=256)
    monkeypatch.setattr(platform, "keep_host_memory", lambda environ=None: True)
    model, policy = resolve_model(small)[0], resolve_policy(small)
    pie = estimate.memory_pie(remat.with_remat(Job(model, 8, 256, 8, policy=policy), "none"), MeshShape(1, 8, 1, 1))
    assert pie.total - pie.params - pie.optimizer <= platform.KEPT_BLOCK_BYTES
    assert auto_remat(small, model, policy, MeshShape(1, 8, 1, 1), cpu) == "none"
    # One device holds the whole batch's activations: 8 times the scratch, past the block.
    assert auto_remat(small, model, policy, MeshShape(1, 1, 1, 1), cpu) == "save_qkv_attn"
    kept = platform.KEPT_BLOCK_BYTES
    monkeypatch.setattr(platform, "KEPT_BLOCK_BYTES", 0)
    assert auto_remat(small, model, policy, MeshShape(1, 8, 1, 1), cpu) == "save_qkv_attn"
    monkeypatch.setattr(platform, "KEPT_BLOCK_BYTES", kept)
    monkeypatch.setattr(platform, "keep_host_memory", lambda environ=None: False)
    assert auto_remat(small, model, policy, MeshShape(1, 8, 1, 1), cpu) == "save_qkv_attn"


def test_train_auto_recomputes_the_mlp_on_cpu_and_takes_the_fitting_policy_on_an_accelerator():
    cfg = TrainConfig(model="llama3-8b", batch_size=8, seq_len=8192, dtype="bfloat16")
    model, policy = resolve_model(cfg)[0], resolve_policy(cfg)
    shape = MeshShape(1, 8, 1, 1)
    assert policy.remat == "auto"
    host = hardware.host_memory_bytes()
    if (
        host / 8
        < estimate.memory_pie(remat.with_remat(Job(model, 8, 8192, 8, policy=policy), "save_qkv_attn"), shape).total
    ):
        assert auto_remat(cfg, model, policy, shape, _Device("cpu", None)) == "full"  # the host's share is too small
    roomy, tight = _Device("gpu", 10**13), _Device("gpu", int(60e9))
    assert auto_remat(cfg, model, policy, shape, roomy) == "none"
    chosen = auto_remat(cfg, model, policy, shape, tight)
    job = Job(model, 8, 8192, 8, policy=policy)
    assert chosen != "none"
    assert estimate.memory_pie(remat.with_remat(job, chosen), shape).total <= 60e9 * (1 - search.HEADROOM)


def test_planning_70b_on_256_devices_is_fast():
    cfg = TrainConfig(model="llama2-70b", batch_size=512, seq_len=4096)
    model, policy = resolve_model(cfg)[0], resolve_policy(cfg, backend="accelerator")
    job, hw = Job(model, 512, 4096, 256, policy=policy), resolve_hardware("h100", 256)
    t0 = time.perf_counter()
    plans, _ = search.search(job, hw)
    assert time.perf_counter() - t0 < 5.0 and plans[0].fits
    assert job.policy.remat == "auto"  # the caller's job is left as it was
