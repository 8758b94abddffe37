"""Whether a training job fits the memory of its devices, and the nearest change that makes it fit.

`within` is the one test of a fit: `meshlm plan` marks a plan as fitting with it, and `meshlm train`
refuses a job before compiling with it (`meshlm.job.check_memory`), so a plan that fits is a job that
train accepts. `device_bytes` is what one device may use: the device's memory as JAX's client reports
it, or on CPU the host's memory less the operating system's share, split over the process's simulated
devices (`meshlm.plan.hardware.host_memory_budget`); `HEADROOM` of it stays free.
"""

from __future__ import annotations

from dataclasses import replace

from meshlm.mesh import MeshShape, all_mesh_shapes
from meshlm.plan import estimate
from meshlm.plan.job import Job
from meshlm.plan.remat import CPU_POLICIES, POLICIES, first_fitting, with_remat

# Headroom kept free on the device (allocator fragmentation, runtime buffers), as a fraction of its memory.
HEADROOM = 0.05


def usable_bytes(device_bytes: float) -> float:
    """What a step's peak may reach on a device with `device_bytes` to use."""
    return device_bytes * (1 - HEADROOM)


def within(peak_bytes: float, device_bytes: float) -> bool:
    """Whether a predicted peak fits a device with `device_bytes` to use."""
    return peak_bytes <= usable_bytes(device_bytes)


def auto_policy(
    job: Job, shape: MeshShape, device_bytes: float, compiler: str = "cpu", kept_block_bytes: float | None = None
) -> str:
    """What `--remat=auto` means for this job, in `meshlm train` and in `meshlm plan --hardware=cpu` alike.

    A backend whose profile keeps the host's scratch between steps (CPU; `kept_block_bytes` given by
    `meshlm.backends.Profile.kept_block_bytes`, 0 where it could not be kept): `none` where the step's scratch
    with every activation kept stays in that block and its peak fits, else the first of `CPU_POLICIES`
    that fits (`meshlm.job.auto_remat` says why). Elsewhere the least recomputation that fits. `full`
    when nothing does, for the memory check to report."""
    budget = usable_bytes(device_bytes)
    if kept_block_bytes is None:
        return first_fitting(job, shape, budget, POLICIES, compiler)[0]
    keep_all = estimate.memory_pie(with_remat(job, "none"), shape, compiler)
    scratch = keep_all.total - keep_all.params - keep_all.optimizer  # freed and allocated again each step
    if scratch <= kept_block_bytes and keep_all.total <= budget:
        return "none"
    return first_fitting(job, shape, budget, CPU_POLICIES, compiler)[0]


def peak(job: Job, shape: MeshShape, compiler: str = "cpu") -> float:
    """The predicted peak bytes per device (`estimate.memory_pie`); `--remat=auto` as `full`, the least
    any policy it may choose needs."""
    if job.policy.remat == "auto":
        job = replace(job, policy=job.policy.replace(remat="full"))
    return estimate.memory_pie(job, shape, compiler).total


def _changes(job: Job, shape: MeshShape):
    """(flag, job, mesh) changes to try, nearest first: more recomputation, more micro-batches, another
    mesh of the same devices, a smaller batch, shorter sequences, a smaller preset."""
    from meshlm.models.presets import PRESETS

    c, run = job.cfg, job.policy
    if run.remat != "auto":
        for policy in POLICIES[POLICIES.index(run.remat) + 1 :]:
            yield f"--remat={policy}", replace(job, policy=run.replace(remat=policy)), shape
    for accum in (2, 4, 8, 16, 32, 64):
        if accum > job.grad_accum and job.batch_size % accum == 0:
            yield f"--grad_accum={accum}", replace(job, grad_accum=accum), shape
    if shape.pp == 1:
        for other in sorted(all_mesh_shapes(shape.n_devices), key=lambda s: (-s.fsdp, -s.tp, s.sp, s.dp)):
            if other != shape:
                yield f"--mesh_dim={other}", job, other
    batch = job.batch_size // 2
    while batch >= job.grad_accum * shape.data and batch % job.grad_accum == 0:
        yield f"--batch_size={batch}", replace(job, batch_size=batch), shape
        batch //= 2
    seq_len = job.seq_len // 2
    while seq_len >= 64:
        yield f"--seq_len={seq_len}", replace(job, seq_len=seq_len), shape
        seq_len //= 2
    smaller = sorted(
        (n for n, p in PRESETS.items() if p.num_params() < c.num_params()), key=lambda n: -PRESETS[n].num_params()
    )
    for name in smaller:
        preset = PRESETS[name]
        if job.seq_len <= preset.max_seq_len:
            yield f"--model={name}", replace(job, cfg=preset), shape


def nearest_fit(job: Job, shape: MeshShape, device_bytes: float, compiler: str = "cpu") -> str | None:
    """The nearest change of flags (`_changes`) under which the job fits `device_bytes`, or None."""
    for flag, trial, trial_shape in _changes(job, shape):
        if trial.problem(trial_shape) is None and within(peak(trial, trial_shape, compiler), device_bytes):
            return flag
    return None


def misfit(
    job: Job, shape: MeshShape, device_bytes: float, compiler: str = "cpu", where: str = "a device"
) -> str | None:
    """One line when the job's predicted peak does not fit `device_bytes` (`where` says whose memory
    that is), naming the nearest change that fits; None when it fits."""
    need = peak(job, shape, compiler)
    if within(need, device_bytes):
        return None
    fix = nearest_fit(job, shape, device_bytes, compiler)
    remat = "" if job.policy.remat == "auto" else f" with --remat={job.policy.remat}"
    return (
        f"this job needs about {need / 1e9:.1f} GB per device{remat} (predicted peak), more than the "
        f"{usable_bytes(device_bytes) / 1e9:.1f} GB that {where}; "
        + (f"nearest change that fits: {fix}" if fix else "nothing nearby fits: use a smaller model or more memory")
    )


def serving_bytes(model, dtype: str, shape: MeshShape, max_batch: int, context: int) -> tuple[float, float]:
    """(weights, KV cache) bytes per device of a serving engine: the weights in the compute `dtype` split
    over tp and fsdp×sp, the cache's keys and values over the data axes, the kv heads on tp and sp; a
    local layer's cache holds its window."""
    import jax.numpy as jnp

    size = jnp.dtype(dtype).itemsize
    weights = model.num_params() * size / (shape.tp * shape.fsdp * shape.sp)
    kv_ways = shape.data * min(shape.tp, model.n_kv_heads) * shape.sp
    slots = sum(model.cache_lengths(context))  # local layers keep only their window
    cache = 2 * slots * max_batch * model.n_kv_heads * model.head_dim * size / kv_ways
    return weights, cache


def serving_misfit(
    model, dtype: str, shape: MeshShape, max_batch: int, context: int, device_bytes: float, where: str = "a device"
) -> str | None:
    """One line when a serving engine's weights and KV cache (`serving_bytes`, in `dtype`) do not fit
    `device_bytes`, naming the smaller --max_seq_len or --max_batch that fits; None when they fit."""
    weights, cache = serving_bytes(model, dtype, shape, max_batch, context)
    if within(weights + cache, device_bytes):
        return None
    head = (
        f"serving needs about {(weights + cache) / 1e9:.1f} GB per device (weights {weights / 1e9:.1f} GB, KV cache "
        f"{cache / 1e9:.1f} GB), more than the {usable_bytes(device_bytes) / 1e9:.1f} GB that {where}"
    )
    lengths = [context >> k for k in range(1, 8) if context >> k >= 64]
    batches = [max_batch >> k for k in range(1, 8) if (max_batch >> k) % shape.data == 0 and max_batch >> k]
    tries = [(f"--max_seq_len={n}", max_batch, n) for n in lengths] + [
        (f"--max_batch={b}", b, context) for b in batches
    ]
    for flag, batch, length in tries:
        if within(sum(serving_bytes(model, dtype, shape, batch, length)), device_bytes):
            return f"{head}; nearest change that fits: {flag}"
    return f"{head}; use a smaller model, a smaller --dtype or more devices"
