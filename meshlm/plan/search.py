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
from meshlm.plan import comms, cost, estimate, fit, memory, pipeline, remat
from meshlm.plan.fit import HEADROOM  # noqa: F401  (kept free of each device's memory)
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job
from meshlm.plan.pipeline import PipelinePlan


@dataclass
class Plan:
    job: Job  # the job as planned on this mesh: `--remat=auto` filled in, maybe more --grad_accum
    shape: MeshShape
    memory: memory.MemoryPie
    collectives: list[comms.Collective]
    operators: list[cost.Operator]
    time: cost.StepTime
    fits: bool
    placement: dict[str, tuple[int, int]]  # per axis: (devices inside a fast domain, fast domains)
    pipeline: PipelinePlan | None = None  # the schedule, stages and transfers when pp > 1
    compiled: dict | None = field(default=None)  # filled by meshlm.explain.verify

    @property
    def mesh_dim(self) -> str:
        return str(self.shape)

    @property
    def label(self) -> str:
        """The mesh as people read it: `1,2,2,1`, or `pp=2 × 1,2,2,1` with pipeline stages."""
        return label(self.shape)

    @property
    def collective_bytes(self) -> dict[str, float]:
        return comms.total_bytes(self.collectives)

    @property
    def comm_bound(self) -> list[cost.Operator]:
        return [op for op in self.operators if op.comm_bound]


def evaluate(job: Job, shape: MeshShape, hw: Hardware) -> Plan:
    """All predictions for one mesh (assumed valid for the job: see `Job.problem`)."""
    pie = estimate.memory_pie(job, shape, memory.compiler_for(hw.name))
    collectives = estimate.collectives(job, shape, hw.backend)
    ops = estimate.operators(job, shape, hw, collectives)
    time = estimate.step_time(job, shape, hw, ops, collectives, pie.params)
    fits = fit.within(pie.total, hw.hbm_bytes)  # the test `meshlm train` makes before compiling
    stages = None
    if shape.pp > 1:
        stages = pipeline.plan_pipeline(job, shape, pie)
        stages.forward_clock_s, stages.backward_clock_s = pipeline.clock_seconds(job, shape, ops, hw)
        transfers = [c for c in collectives if c.op == "pipeline" and c.kind == "collective-permute"]
        stages.transfer_s = sum(comms.wire_seconds(c, shape, hw) for c in transfers)
        split = comms.axis_split(shape, hw)["pp"]
        stages.link = hw.slow_name if split[1] > 1 else hw.fast_name
    return Plan(job, shape, pie, collectives, ops, time, fits, comms.axis_split(shape, hw), stages)


def best_on(job: Job, shape: MeshShape, hw: Hardware) -> Plan:
    """The plan for this mesh: with `--remat=auto`, the fastest policy that fits at the fewest
    gradient-accumulation micro-batches that make one fit (`meshlm.plan.remat`); the smallest if none does.
    On simulated CPU devices the policy `meshlm train` takes for `auto` (`fit.auto_policy`)."""
    if job.policy.remat != "auto":
        return evaluate(job, shape, hw)
    budget, compiler = fit.usable_bytes(hw.hbm_bytes), memory.compiler_for(hw.name)
    if hw.name == "cpu":
        return _best_on_cpu(job, shape, hw)
    smallest, smallest_bytes = None, math.inf
    for trials in remat.variants(job, shape):
        # Memory first (cheap); the step-time model only for the policies that fit.
        peaks = [estimate.memory_pie(trial, shape, compiler).total for trial in trials]
        fitting = [evaluate(trial, shape, hw) for trial, peak in zip(trials, peaks) if peak <= budget]
        if fitting:
            return min(fitting, key=lambda p: p.time.step_s)
        least = min(range(len(trials)), key=peaks.__getitem__)
        if peaks[least] < smallest_bytes:
            smallest, smallest_bytes = trials[least], peaks[least]
    assert smallest is not None, "remat.variants yields at least one policy"
    return evaluate(smallest, shape, hw)


def _best_on_cpu(job: Job, shape: MeshShape, hw: Hardware) -> Plan:
    """`best_on` for simulated CPU devices: train's choice of policy (`fit.auto_policy`, with the block of
    scratch the host allocator keeps where this machine keeps it), at the fewest micro-batches that fit."""
    from meshlm.backends import CPU

    kept = CPU.kept_block_bytes()  # as train sets it
    plan = None
    for trials in remat.variants(job, shape):
        trial = replace(trials[0], policy=job.policy)
        policy = fit.auto_policy(trial, shape, hw.hbm_bytes, "cpu", kept)
        plan = evaluate(remat.with_remat(trial, policy), shape, hw)
        if plan.fits:
            return plan
    assert plan is not None, "remat.variants yields at least one policy"
    return plan


def label(shape: MeshShape) -> str:
    return str(shape) if shape.pp == 1 else f"pp={shape.pp} × {shape}"


def _rank_key(plan: Plan):
    return (not plan.fits, plan.time.step_s, -plan.shape.fsdp, plan.memory.total)


def candidate_shapes(
    job: Job, mesh_dim: MeshShape | None = None, pps: tuple[int, ...] = (1,)
) -> tuple[list[MeshShape], dict[str, str]]:
    """Meshes that can run the job (with each pipeline size in `pps`), and why each other one cannot."""
    if mesh_dim is not None:
        shapes = [mesh_dim]
    else:
        shapes = [
            replace(s, pp=pp) for pp in pps if job.n_devices % pp == 0 for s in all_mesh_shapes(job.n_devices // pp)
        ]
    valid, rejected = [], {}
    for shape in shapes:
        problem = job.problem(shape)
        if problem:
            rejected[label(shape)] = problem
        else:
            valid.append(shape)
    return valid, rejected


def auto_pps(job: Job) -> tuple[int, ...]:
    """Pipeline sizes `--pp=auto` tries: 1 and every divisor of the devices that splits the layers."""
    return (1, *pipeline.pp_candidates(job.n_devices, job.cfg.n_layers, job.pipeline.virtual_stages))


def search(
    job: Job, hw: Hardware, mesh_dim: MeshShape | None = None, pps: tuple[int, ...] = (1,)
) -> tuple[list[Plan], dict[str, str]]:
    """Ranked plans (best first) and the rejected meshes with their reason; `pps`: the pipeline sizes
    to consider when no mesh is given.

    Raises UsageError naming the nearest change that works when no mesh can run the job or none fits.
    """
    valid, rejected = candidate_shapes(job, mesh_dim, pps)
    if not valid:
        raise UsageError(_no_valid_mesh(job, rejected, mesh_dim, pps))
    plans = sorted((best_on(job, s, hw) for s in valid), key=_rank_key)
    if not plans[0].fits:
        raise UsageError(_nothing_fits(job, hw, min(plans, key=lambda p: p.memory.total), mesh_dim, pps))
    return plans, rejected


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _no_valid_mesh(job: Job, rejected: dict[str, str], mesh_dim: MeshShape | None, pps: tuple[int, ...]) -> str:
    if mesh_dim is not None:
        others, _ = candidate_shapes(job, pps=(mesh_dim.pp,))
        hint = (
            ("meshes that work: " + ", ".join(s.flags for s in others[:3]))
            if others
            else "no mesh of these devices works either"
        )
        return f"{mesh_dim.flags}: {rejected[label(mesh_dim)]}; {hint}"
    if pps != (1,):
        first = next(iter(rejected.items()))
        which = f"--pp={pps[0]}" if len(pps) == 1 else "--pp=auto"
        return (
            f"{which}: no mesh of {job.n_devices} devices can run this job (e.g. {first[0]}: {first[1]}); "
            "change --microbatches, --batch_size or the devices"
        )
    # Every mesh failed: the cheapest fix is usually a batch that covers the data axes.
    c = job.cfg
    model_parallel = max(math.gcd(job.n_devices, math.gcd(c.n_heads, math.gcd(c.mlp_dim, c.vocab_size))), 1)
    need = max(1, job.n_devices // model_parallel) * job.grad_accum
    return (
        f"no mesh of {job.n_devices} devices can run this job (e.g. {next(iter(rejected.values()))}); "
        f"raise --batch_size to a multiple of {need}, or use fewer --devices"
    )


def _nothing_fits(job: Job, hw: Hardware, best: Plan, mesh_dim: MeshShape | None, pps: tuple[int, ...] = (1,)) -> str:
    budget, compiler = fit.usable_bytes(hw.hbm_bytes), memory.compiler_for(hw.name)
    searched = job.policy.remat == "auto"
    head = (
        f"nothing fits in {_gb(hw.hbm_bytes)} per {hw.name}: the smallest plan ({best.shape.flags}"
        f"{' --remat=' + best.job.policy.remat if searched else ''}) needs {_gb(best.memory.total)} per device"
    )
    if searched:  # every policy and more micro-batches were tried: what is left is more devices or pipelines
        job = best.job
    tries = []
    if job.policy.remat != "full" and not searched:
        tries.append(("--remat=full", replace(job, policy=job.policy.replace(remat="full")), pps))
    for accum in (2, 4, 8, 16):
        if job.batch_size % accum == 0 and accum > job.grad_accum and pps == (1,):
            tries.append((f"--grad_accum={accum}", replace(job, grad_accum=accum), pps))
    if mesh_dim is None and job.grad_accum == 1:  # pipeline stages, when the plan did not consider them
        tries += [(f"--pp={pp}", job, (pp,)) for pp in auto_pps(job)[1:] if pp not in pps]
    # Simulated CPU devices share one host's memory: more of them hold no more.
    for factor in () if hw.name == "cpu" else (2, 4, 8, 16):
        tries.append((f"--devices={job.n_devices * factor}", replace(job, n_devices=job.n_devices * factor), pps))
    for flag, trial, trial_pps in tries:
        shapes = [mesh_dim] if mesh_dim is not None and trial.n_devices == job.n_devices else None
        valid = shapes or candidate_shapes(trial, pps=trial_pps)[0]
        valid = [s for s in valid if trial.problem(s) is None]
        fitting = [s for s in valid if estimate.memory_pie(trial, s, compiler).total <= budget]
        if fitting:
            if flag.startswith("--pp="):
                smallest = min(fitting, key=lambda s: estimate.memory_pie(trial, s, compiler).total)
                flag = f"{flag} (e.g. {smallest.flags})"
            return f"{head}; nearest change that fits: {flag}"
    if hw.name == "cpu":  # a smaller batch, shorter sequences or a smaller model, as train's check says
        fix = fit.nearest_fit(job, best.shape, hw.hbm_bytes, compiler)
        return f"{head}; " + (f"nearest change that fits: {fix}" if fix else "use a smaller model or a larger host")
    return f"{head}; even 16x the devices with --remat=full does not fit: use a smaller model or shorter --seq_len"
