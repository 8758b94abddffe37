"""`explain(cfg)`: the train step of a job compiled as `meshlm train` would compile it (no data, no
training), and what came out as one dict: parameter layouts, memory, collectives, layer-group
boundaries, the picture of one tensor, and with `--pp` the stages, schedule and stage transfers.

`compile_step(job, cfg)` is the compile alone, for callers that read the compiled program further.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshlm.config import TrainConfig
from meshlm.job import Job


@dataclass
class CompiledStep:
    """The compiled train step of a job and the abstract inputs it was compiled for."""

    step: Any  # jax.stages.Compiled
    grads: Any  # the compiled gradient function (None with --pp: its layouts are read instead)
    state: Any  # the abstract train state (None without --pp)
    batch: dict


def compile_step(job: Job, cfg: TrainConfig) -> CompiledStep:
    from meshlm.optimizer import OptimizerConfig, make_optimizer
    from meshlm.train.state import abstract_state
    from meshlm.train.step import abstract_batch, make_train_step
    from meshlm.train.step import compile_step as compile_train_step

    optimizer = make_optimizer(OptimizerConfig(clip_norm=cfg.clip_norm, weight_decay=cfg.weight_decay))
    if job.pipeline is None:
        step, grads, batch = compile_train_step(job.placement, optimizer, cfg.batch_size, cfg.seq_len, cfg.grad_accum)
        return CompiledStep(step, grads, None, batch)
    # The pipelined step; its gradients are read from their layouts (one compile, not two).
    state, batch = abstract_state(job.placement, optimizer), abstract_batch(job.placement, cfg.batch_size, cfg.seq_len)
    jitted: Any = make_train_step(job.placement, optimizer, pipeline=job.pipeline)
    step = jitted.lower(state, batch).compile()
    return CompiledStep(step, None, state, batch)


def explain(
    cfg: TrainConfig,
    tensor: str | None = None,
    png: str | None = None,
    job: Job | None = None,
    compiled: CompiledStep | None = None,
) -> dict:
    """Everything `meshlm explain` shows, as one dict (specs and shapes as text). `job` and `compiled`
    are resolved and compiled here unless given."""
    import jax
    import numpy as np

    from meshlm import job as joblib
    from meshlm.explain import analysis as A
    from meshlm.explain import pipeline as PL
    from meshlm.explain.names import readable

    job = job or joblib.resolve(cfg, output=False)
    compiled = compiled or compile_step(job, cfg)
    placement, pipeline, step = job.placement, job.pipeline, compiled.step
    rows = A.param_rows(placement)
    tensor = tensor or next((r["path"] for r in rows if r["path"].endswith("mlp/gate")), rows[0]["path"])
    found = A.collectives(step.as_text(), placement)
    report = {
        "mesh_dim": str(job.shape),
        "pp": job.shape.pp,
        "platform": jax.devices()[0].platform,
        "strategy": job.strategy.name,
        "groups": [{"layers": g.key, "strategy": g.strategy.name} for g in placement.groups],
        "parameters": [
            {**r, "shape": list(r["shape"]), **{k: str(r[k]) for k in ("spec", "grad_spec", "opt_spec")}} for r in rows
        ],
        "memory": A.state_memory(placement, step, compiled.grads, compiled.batch),
        "collectives": [
            dict(
                kind=c.kind,
                axes=list(c.axes),
                payload_bytes=c.payload_bytes,
                count=c.count,
                total_bytes=c.total_bytes,
                where=readable(c.where),
                op_name=c.where,
                role=PL.role(c),
            )
            for c in found
        ],
        "boundaries": [
            {
                **b,
                "spec_before": str(b["spec_before"]),
                "spec_after": str(b["spec_after"]),
                "forward": [c.__dict__ for c in b["forward"]],
                "backward": [c.__dict__ for c in b["backward"]],
            }
            for b in A.boundaries(placement, cfg.batch_size // cfg.grad_accum, cfg.seq_len)
        ],
        "tensor": tensor,
        "picture": A.picture(placement, tensor),
    }
    if pipeline is not None:
        mb_shape = (cfg.batch_size // pipeline.microbatches, cfg.seq_len, job.model.d_model)
        moves = PL.transfers(found, pipeline, mb_shape, np.dtype(job.policy.dtype).itemsize)
        report["pipeline"] = {
            "schedule": PL.describe(pipeline),
            "stages": PL.stage_layout(placement, pipeline),
            "memory": PL.stage_memory(step, compiled.state, compiled.batch, moves["per_device_bytes"], pipeline),
            "transfers": moves,
        }
    if png:
        report["png"] = str(A.write_png(placement, tensor, png))
    return report
