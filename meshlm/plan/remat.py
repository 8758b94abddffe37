"""`--remat=auto`: which rematerialisation policy (and, in `meshlm plan`, how many gradient-accumulation
micro-batches) a job needs on a mesh. The policies, least recomputation first: `meshlm.models.remat`.

`meshlm plan` rates each with the cost model and keeps the fastest that fits; `meshlm train` (which
has no step-time model of the machine it runs on) takes the first in this order whose predicted peak
fits the device's memory, and on CPU `none` while the step's scratch fits in the block the host allocator
keeps, else the first of `CPU_POLICIES` (see `meshlm.job.auto_remat`).
"""

from __future__ import annotations

from dataclasses import replace

from meshlm.mesh import MeshShape
from meshlm.models.remat import POLICIES  # least recomputation first
from meshlm.plan import estimate
from meshlm.plan.job import Job

CPU_POLICIES = (
    "save_qkv_attn",
    "full",
)  # XLA:CPU past a kept block of scratch: recomputing beats storing (meshlm.job.auto_remat)
ACCUMS = (1, 2, 4, 8, 16, 32, 64)


def with_remat(job: Job, policy: str) -> Job:
    return replace(job, policy=job.policy.replace(remat=policy))


def variants(job: Job, shape: MeshShape):
    """The jobs `auto` tries on this mesh, one list per gradient-accumulation count (the user's
    first, then more when the micro-batch still divides over the data axes; pipelines keep theirs):
    every policy for each."""
    if job.policy.remat != "auto":
        yield [job]
        return
    accums = (
        [job.grad_accum] if shape.pp > 1 else [a for a in ACCUMS if a >= job.grad_accum and job.batch_size % a == 0]
    )
    for accum in accums:
        trial = replace(job, grad_accum=accum)
        if accum != job.grad_accum and trial.problem(shape):
            continue
        yield [with_remat(trial, p) for p in POLICIES]


def first_fitting(
    job: Job, shape: MeshShape, budget_bytes: float, policies: tuple[str, ...] = POLICIES, compiler: str = "cpu"
) -> tuple[str, float]:
    """(policy, predicted peak bytes per device): the first of `policies` (least recomputation first)
    whose peak fits `budget_bytes`, else `full` (the smallest) with its peak, for the caller to report."""
    peak = 0.0
    for policy in policies:
        peak = estimate.memory_pie(with_remat(job, policy), shape, compiler).total
        if peak <= budget_bytes:
            return policy, peak
    return "full", peak
