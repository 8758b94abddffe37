"""Evaluate every mesh of the devices, rank the ones that fit, and recommend one.

A plan is one mesh with its predictions: memory pie, collectives, operator table, step time.
Ranking: meshes whose peak memory fits the device first, fastest predicted step first; ties go to
the larger fsdp (the usual advice) and then to less memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshlm.errors import UsageError
from meshlm.mesh import MeshShape, all_mesh_shapes
from meshlm.plan import comms, cost, memory
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job

# Headroom kept free on the device (allocator fragmentation, runtime buffers), as a fraction of HBM.
HEADROOM = 0.05


@dataclass
class Plan:
    shape: MeshShape
    memory: memory.MemoryPie
    collectives: list[comms.Collective]
    operators: list[cost.Operator]
    time: cost.StepTime
    fits: bool
    placement: dict[str, tuple[int, int]]  # per axis: (devices inside a fast domain, fast domains)
    compiled: dict | None = field(default=None)  # filled by meshlm.plan.verify

    @property
    def mesh_dim(self) -> str:
        return str(self.shape)

    @property
    def collective_bytes(self) -> dict[str, float]:
        return comms.total_bytes(self.collectives)

    @property
    def comm_bound(self) -> list[cost.Operator]:
        return [op for op in self.operators if op.comm_bound]


def evaluate(job: Job, shape: MeshShape, hw: Hardware) -> Plan:
    """All predictions for one mesh (assumed valid for the job: see `Job.problem`)."""
    pie = memory.estimate(job, shape)
    collectives = comms.predict(job, shape)
    ops = cost.operator_table(job, shape, hw, collectives)
    time = cost.step_time(job, shape, hw, ops, collectives, pie.params)
    fits = pie.total <= hw.hbm_bytes * (1 - HEADROOM)
    return Plan(shape, pie, collectives, ops, time, fits, comms.axis_split(shape, hw))


def _rank_key(plan: Plan):
    return (not plan.fits, plan.time.step_s, -plan.shape.fsdp, plan.memory.total)


def candidate_shapes(job: Job, mesh_dim: MeshShape | None = None) -> tuple[list[MeshShape], dict[str, str]]:
    """Meshes that can run the job, and why each other one cannot."""
    shapes = [mesh_dim] if mesh_dim is not None else all_mesh_shapes(job.n_devices)
    valid, rejected = [], {}
    for shape in shapes:
        problem = job.problem(shape)
        if problem:
            rejected[str(shape)] = problem
        else:
            valid.append(shape)
    return valid, rejected


def search(job: Job, hw: Hardware, mesh_dim: MeshShape | None = None) -> tuple[list[Plan], dict[str, str]]:
    """Ranked plans (best first) and the rejected meshes with their reason.

    Raises UsageError naming the nearest change that works when no mesh can run the job or none fits.
    """
    valid, rejected = candidate_shapes(job, mesh_dim)
    if not valid:
        raise UsageError(_no_valid_mesh(job, rejected, mesh_dim))
    plans = sorted((evaluate(job, s, hw) for s in valid), key=_rank_key)
    if not plans[0].fits:
        raise UsageError(_nothing_fits(job, hw, min(plans, key=lambda p: p.memory.total), mesh_dim))
    return plans, rejected


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _no_valid_mesh(job: Job, rejected: dict[str, str], mesh_dim: MeshShape | None) -> str:
    if mesh_dim is not None:
        others, _ = candidate_shapes(job)
        hint = ("meshes that work: " + ", ".join(f"--mesh_dim={s}" for s in others[:3])) if others else \
            "no mesh of these devices works either"
        return f"--mesh_dim={mesh_dim}: {rejected[str(mesh_dim)]}; {hint}"
    # Every mesh failed: the cheapest fix is usually a batch that covers the data axes.
    c = job.cfg
    model_parallel = max(math.gcd(job.n_devices, math.gcd(c.n_heads, math.gcd(c.n_kv_heads, math.gcd(c.mlp_dim, c.vocab_size)))), 1)
    need = max(1, job.n_devices // model_parallel) * job.grad_accum
    return (f"no mesh of {job.n_devices} devices can run this job (e.g. {next(iter(rejected.values()))}); "
            f"raise --batch_size to a multiple of {need}, or use fewer --devices")


def _nothing_fits(job: Job, hw: Hardware, best: Plan, mesh_dim: MeshShape | None) -> str:
    budget = hw.hbm_bytes * (1 - HEADROOM)
    head = (f"nothing fits in {_gb(hw.hbm_bytes)} per {hw.name}: the smallest plan (--mesh_dim={best.mesh_dim}) "
            f"needs {_gb(best.memory.total)} per device")
    tries = []
    if job.cfg.remat != "full":
        tries.append(("--remat=full", replace(job, cfg=job.cfg.replace(remat="full"))))
    for accum in (2, 4, 8, 16):
        if job.batch_size % accum == 0 and accum > job.grad_accum:
            tries.append((f"--grad_accum={accum}", replace(job, grad_accum=accum)))
    for factor in (2, 4, 8, 16):
        tries.append((f"--devices={job.n_devices * factor}", replace(job, n_devices=job.n_devices * factor)))
    for flag, trial in tries:
        shapes = [mesh_dim] if mesh_dim is not None and trial.n_devices == job.n_devices else None
        valid = shapes or candidate_shapes(trial)[0]
        valid = [s for s in valid if trial.problem(s) is None]
        fitting = [s for s in valid if memory.estimate(trial, s).total <= budget]
        if fitting:
            return f"{head}; nearest change that fits: {flag}"
    return f"{head}; even 16x the devices with --remat=full does not fit: use a smaller model or shorter --seq_len"
