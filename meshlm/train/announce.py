"""The lines a run prints about itself before its first step: model, mesh, strategy, pipeline,
processes, evaluation, data and what trains."""

from __future__ import annotations

import jax

from meshlm.models.configs import describe
from meshlm.train.console import plural
from meshlm.train.setup import Run


def model_lines(run: Run) -> list[str]:
    cfg, job = run.cfg, run.job
    model_cfg, policy, shape = job.model, job.policy, job.shape
    remat = policy.remat + (" (auto)" if cfg.remat == "auto" else "")
    return [
        f"model: {cfg.model or job.init_source or 'tiny'} — {describe(model_cfg)}; compute {policy.dtype}, "
        f"params {policy.param_dtype}, remat {remat}",
        f"mesh: {shape.flags} ({', '.join(f'{k}={v}' for k, v in shape.as_dict().items())}) on "
        f"{plural(jax.device_count(), jax.devices()[0].platform + ' device')}; batch {cfg.batch_size} × seq "
        f"{cfg.seq_len}, grad_accum {cfg.grad_accum}",
    ]


def layout_lines(run: Run) -> list[str]:
    """The strategy (when not the default), the pipeline and the processes across hosts."""
    job, lines = run.job, []
    strategy, rules, placement, pipeline, shape, dcn = (
        job.strategy,
        job.rules,
        job.placement,
        job.pipeline,
        job.shape,
        job.dcn,
    )
    if strategy.name != "default" or rules:
        groups = ", ".join(f"layers {g.key}: {g.strategy.name}" for g in placement.groups)
        lines.append(
            f"strategy: {strategy.name}"
            + (f" ({groups})" if groups else "")
            + (f"; {plural(len(rules.rules), 'rule')} from {rules.path}" if rules else "")
            + " — `meshlm explain` with the same flags shows every layout and collective"
        )
    if pipeline is not None:
        lines.append(
            f"pipeline: {pipeline.name}, {shape.pp} stages"
            + (f" × {pipeline.virtual} virtual" if pipeline.virtual > 1 else "")
            + f", {pipeline.microbatches} microbatches, {pipeline.clocks} clocks; bubble "
            f"{pipeline.bubble():.1%} ((p-1)/(m·v+p-1) = {pipeline.theoretical_bubble():.1%}); "
            f"at most {pipeline.act_slots} microbatch inputs stashed per stage"
        )
    if jax.process_count() > 1:
        lines.append(
            f"{plural(jax.process_count(), 'process')} × {plural(jax.local_device_count(), 'device')}; "
            f"across hosts --dcn_mesh_dim={dcn} ({', '.join(f'{k}={v}' for k, v in dcn.as_dict().items() if v > 1)})"
        )
    return lines


def data_lines(run: Run) -> list[str]:
    """Evaluation, chat data and how many passes over the data the run makes."""
    cfg, loader, lines = run.cfg, run.loader, []
    if run.eval_batches is not None:
        held_out = (
            f" ({plural(len(loader.held_out), 'row')} held out of training)"
            if loader.held_out is not None
            else " (synthetic: random rows no training step draws)"
        )
        source = (
            f"--eval_dataset={cfg.eval_dataset}" if cfg.eval_dataset else f"--eval_split={cfg.eval_split}" + held_out
        )
        lines.append(
            f"eval: {plural(run.eval_batches.n_batches, 'batch')} of {cfg.batch_size} rows from {source}"
            f", every {cfg.eval_every or max(1, cfg.steps // 10)} steps and after the last"
        )
    if loader.chat_data is not None:
        lines.append(loader.chat_data.describe(cfg.seq_len, loader.chat))
    if loader.steps_per_epoch:  # real data: how many times this run reads it
        lines.append(
            f"data: a pass over the data (an epoch) is {plural(loader.steps_per_epoch, 'step')} of "
            f"{cfg.batch_size} rows; --steps={cfg.steps} makes {cfg.steps / loader.steps_per_epoch:.3g} passes"
        )
    return lines


def run_lines(run: Run) -> list[str]:
    return [
        *model_lines(run),
        *layout_lines(run),
        *data_lines(run),
        *run.trainable.describe(run.job.init_source, run.cfg.seed),
    ]
