"""The set-up phase of a run: the job placed on the mesh, what trains, the data, the optimizer and
the run's metadata, each checked before any compile work (`set_up`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import optax

from meshlm import data, distributed
from meshlm import job as joblib
from meshlm.errors import UsageError
from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer
from meshlm.train.trainable import Trainable, trainable_for


@dataclasses.dataclass
class Run:
    """What set-up hands the later phases."""

    cfg: Any
    job: Any  # meshlm.job.Job: the model placed on the mesh
    trainable: Trainable
    tokenizer: Any
    loader: Any
    eval_batches: Any  # None: the run does not evaluate
    opt_cfg: OptimizerConfig
    optimizer: optax.GradientTransformation
    schedule: dict  # the learning-rate schedule the metadata records
    meta: dict  # the run's metadata: config.json, each checkpoint's, the tracker's
    out: Path
    is_main: bool  # process 0: logs, progress and files come from it only


def latest_step(directory: Path) -> int | None:
    """The newest complete checkpoint's step in `directory`, or None. Read from the folder names (a
    checkpoint being written has a temporary name until it is complete), not through Orbax: opening a
    CheckpointManager is a barrier across processes, and whether the folder exists yet differs between
    processes here (the first to open the run's own manager creates it), so a probe would pair one
    process's barrier with another's and hang both."""
    if not directory.is_dir():
        return None
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    return max(steps, default=None)


def load_data(cfg, job) -> tuple[Any, Any, Any]:
    """(tokenizer, loader, eval batches or None): the tokenizer is `--tokenizer`, else the one beside
    `--init_from`'s weights; one that does not fit the model's vocabulary is one line."""
    model_cfg, init_source = job.model, job.init_source
    tokenizer_spec = cfg.tokenizer
    if tokenizer_spec is None and init_source is not None:
        found = [d for d in (init_source, init_source / "tokenizer") if (d / "tokenizer.json").is_file()]
        tokenizer_spec = str(found[0]) if found else None
    tokenizer = data.load_tokenizer(tokenizer_spec, cfg.dataset, model_cfg.vocab_size, text_field=cfg.text_field)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_cfg.vocab_size}; "
            f"set --model.vocab_size={tokenizer.vocab_size} (rounded up to a multiple of tp)"
        )
    prepare_alone_without_shared_cache(cfg, tokenizer)
    loader = data.make_loader(
        cfg.dataset,
        tokenizer,
        cfg.seq_len,
        cfg.batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        seed=cfg.seed,
        eval_split=cfg.eval_split,  # None: every row trains, in the order it always had
        text_field=cfg.text_field,
        chat_template=cfg.chat_template,
        loss_on=cfg.loss_on,
        long_conversations=cfg.long_conversations,  # chat data (meshlm.data.chat) only
    )
    eval_batches = data.make_eval_batches(loader, cfg.eval_dataset, cfg.eval_batches) if cfg.evaluates else None
    return tokenizer, loader, eval_batches


def prepare_alone_without_shared_cache(cfg, tokenizer) -> None:
    """Several processes split a corpus's tokenizing only where they share the cache folder; on hosts each
    with a folder of its own, every process prepares the whole corpus first (the loader then finds it)."""
    if jax.process_count() == 1:
        return
    corpora = data.token_corpora(cfg.dataset, cfg.text_field)
    if cfg.eval_dataset:
        corpora += data.token_corpora(cfg.eval_dataset, cfg.text_field)
    if not corpora or distributed.folder_is_shared(data.cache_root(), jax.process_index(), jax.process_count()):
        return
    if jax.process_index() == 0:
        print(
            f"[meshlm] the cache folder {data.cache_root()} is not shared by the hosts: each prepares the data itself"
        )
    for spec, text_field in corpora:
        data.prepare_tokens(spec, tokenizer, text_field=text_field)


def optimizer_config(cfg) -> OptimizerConfig:
    """AdamW and its schedule; a default warmup is a tenth of the schedule (at most 1000 steps)."""
    schedule_steps = cfg.schedule_steps or cfg.steps
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(1000, schedule_steps // 10)
    return OptimizerConfig(
        lr=cfg.lr,
        warmup_steps=warmup,
        total_steps=schedule_steps,
        min_lr_ratio=cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay,
        clip_norm=cfg.clip_norm,
    )


def warmup_note(cfg, opt_cfg: OptimizerConfig) -> str | None:
    """A note when an explicit `--warmup_steps` keeps the learning rate from reaching `--lr`."""
    if opt_cfg.warmup_steps < cfg.steps or cfg.warmup_steps is None:
        return None
    end = float(lr_schedule(opt_cfg)(cfg.steps))
    return (
        f"note: --warmup_steps={opt_cfg.warmup_steps} is not below --steps={cfg.steps}: the learning rate never "
        f"reaches --lr={cfg.lr:g} (it is {end:.3g} at the last step); lower --warmup_steps to reach it"
    )


def set_up(cfg, job, trainable: Trainable, is_main: bool) -> Run:
    """The data, the optimizer and the run's metadata of `job` (already resolved)."""
    tokenizer, loader, eval_batches = load_data(cfg, job)
    opt_cfg = optimizer_config(cfg)
    schedule = {
        "lr": cfg.lr,
        "warmup_steps": opt_cfg.warmup_steps,
        "total_steps": opt_cfg.total_steps,
        "min_lr_ratio": cfg.min_lr_ratio,
    }
    meta = {
        "model": dataclasses.asdict(job.model),
        "policy": dataclasses.asdict(job.policy),
        "mesh_dim": str(job.shape),
        "mesh": job.shape.flags,
        "seed": cfg.seed,
        "schedule": schedule,
        "train": cfg.as_flags(),
        **trainable.meta(job.init_source, cfg.seed),
    }
    return Run(
        cfg,
        job,
        trainable,
        tokenizer,
        loader,
        eval_batches,
        opt_cfg,
        make_optimizer(opt_cfg),
        schedule,
        meta,
        Path(cfg.output_dir),
        is_main,
    )


def resolve(cfg) -> tuple[Any, Trainable]:
    """Every check that needs no data, before any data is read: model, mesh, pipeline, strategy, layouts,
    what trains."""
    job = joblib.resolve(cfg)
    return job, trainable_for(cfg, job.placement)


def write_run_files(run: Run) -> None:
    """config.json and the tokenizer (with a chat template: served as it was trained), from process 0."""
    if not run.is_main:
        return
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "config.json").write_text(json.dumps(run.meta, indent=2, default=str))
    if hasattr(run.tokenizer, "path"):
        run.tokenizer.save(run.out / "tokenizer")
        if run.loader.chat_data is not None:
            run.loader.chat_data.save_template(run.out / "tokenizer")
