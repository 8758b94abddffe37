"""`train(cfg)`: the training loop over the library pieces (job, state, step, data, evaluation, metrics,
checkpoints).

`meshlm.job.resolve` turns the `TrainConfig` (meshlm.config) into a model placed on the mesh; this
module reads the data, restores or initialises the state, runs the jitted step, evaluates and logs.
A run whose checkpoint is already at `--steps` stops before any of that, saying so
(`meshlm.train.report` words every message about the run).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

from meshlm.config import TrainConfig
from meshlm.errors import UsageError
from meshlm.flops import model_flops_per_token


class StopRequest:
    """SIGTERM / SIGINT ask the loop to save at the next step boundary and exit cleanly."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, _frame):
        self.requested = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def train(cfg: TrainConfig, console=None) -> dict[str, Any]:
    """Run a training job end to end; returns a summary (first and last loss, throughput, paths).

    With several processes (the cluster flags or a cluster's environment) this process joins the
    others first; an error in any of them is one line and ends them all."""
    from meshlm import distributed

    cfg.validate()
    cluster = distributed.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.peer_timeout)
    return distributed.run_here(cluster, lambda main: _locked(cfg, console, main), cfg.devices, cfg.connect_timeout)


def _locked(cfg: TrainConfig, console, main: bool) -> dict[str, Any]:
    """`_train` holding the run folder's lock (process 0's), taken before anything reads or writes it."""
    from meshlm.train.run_lock import run_folder_lock

    with run_folder_lock(cfg.output_dir, enabled=main):
        return _train(cfg, console)


def _latest_step(directory: Path) -> int | None:
    """The newest complete checkpoint's step in `directory`, or None. Read from the folder names (a
    checkpoint being written has a temporary name until it is complete), not through Orbax: opening a
    CheckpointManager is a barrier across processes, and whether the folder exists yet differs between
    processes here (the first to open the run's own manager creates it), so a probe would pair one
    process's barrier with another's and hang both."""
    if not directory.is_dir():
        return None
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir()]
    return max(steps, default=None)


def _train(cfg: TrainConfig, console) -> dict[str, Any]:
    import jax

    from meshlm import data, job as joblib
    from meshlm.checkpoint.manager import Checkpointer
    from meshlm.models.configs import describe
    from meshlm.train import metrics as M, report
    from meshlm.config import profile_range
    from meshlm.train.console import plural, run_console
    from meshlm.ops.kernels import gpu_capability
    from meshlm.train.diagnostics import DocumentsWatch, NonFiniteWatch, StepProfiler
    from meshlm.train.evaluate import Evaluator, eval_steps
    from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer
    from meshlm.train.state import abstract_state, create_train_state, train_state_from_params
    from meshlm.train.state import checkpointed, earlier_layouts, eval_params, frozen_base, lora_for, lora_meta, with_base
    from meshlm.train.step import make_train_step, put_batch, sequence_permutation

    is_main = jax.process_index() == 0  # logs, progress and files come from process 0 only
    console = console or run_console(quiet=not is_main)
    # Every check that needs no data, before any data is read: model, mesh, pipeline, strategy, layouts.
    job = joblib.resolve(cfg)
    model_cfg, shape, dcn, pipeline, init_source = job.model, job.shape, job.dcn, job.pipeline, job.init_source
    strategy, rules, placement = job.strategy, job.rules, job.placement
    lora = lora_for(cfg, placement)  # --lora_rank: adapters on a frozen base (None: every weight trains)
    if cfg.mp_mesh_dim:
        console.print(f"--mp_mesh_dim={cfg.mp_mesh_dim}{' --fsdp' if cfg.fsdp else ''} is --mesh_dim={shape}")
    out = Path(cfg.output_dir)
    latest = _latest_step(out / "checkpoints")
    if latest is not None and latest >= cfg.steps:  # a finished run: say so, before any data or compile work
        console.print(report.already_done(cfg.output_dir, latest, cfg.steps))
        return {"interrupted": None, "already_done": True, "checkpoint_step": latest, "first_step": None,
                "last_step": latest, "steps_run": 0, "first_loss": None, "final_loss": None, "compile_seconds": None,
                "steps": cfg.steps, "mesh_dim": str(shape), "output_dir": str(out), "history": [], "evals": []}
    tokenizer_spec = cfg.tokenizer
    if tokenizer_spec is None and init_source is not None:
        found = [d for d in (init_source, init_source / "tokenizer") if (d / "tokenizer.json").is_file()]
        tokenizer_spec = str(found[0]) if found else None
    n_devices = jax.device_count()
    tokenizer = data.load_tokenizer(tokenizer_spec, cfg.dataset, model_cfg.vocab_size, text_field=cfg.text_field)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_cfg.vocab_size}; "
            f"set --model.vocab_size={tokenizer.vocab_size} (rounded up to a multiple of tp)"
        )
    loader = data.make_loader(
        cfg.dataset, tokenizer, cfg.seq_len, cfg.batch_size,
        process_index=jax.process_index(), process_count=jax.process_count(), seed=cfg.seed,
        eval_split=cfg.eval_split,  # None: every row trains, in the order it always had
        text_field=cfg.text_field, chat_template=cfg.chat_template, loss_on=cfg.loss_on,
        long_conversations=cfg.long_conversations,  # chat data (meshlm.data.chat) only
    )
    eval_batches = data.make_eval_batches(loader, cfg.eval_dataset, cfg.eval_batches) if cfg.evaluates else None

    schedule_steps = cfg.schedule_steps or cfg.steps
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(1000, schedule_steps // 10)
    opt_cfg = OptimizerConfig(
        lr=cfg.lr, warmup_steps=warmup, total_steps=schedule_steps, min_lr_ratio=cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm,
    )
    optimizer = make_optimizer(opt_cfg)
    if warmup >= cfg.steps and cfg.warmup_steps is not None:  # a default warmup is a tenth of the schedule
        end = float(lr_schedule(opt_cfg)(cfg.steps))
        console.print(f"note: --warmup_steps={warmup} is not below --steps={cfg.steps}: the learning rate never reaches "
                      f"--lr={cfg.lr:g} (it is {end:.3g} at the last step); lower --warmup_steps to reach it")
    remat = model_cfg.remat + (" (auto)" if cfg.remat == "auto" else "")
    console.print(f"model: {cfg.model or init_source or 'tiny'} — {describe(model_cfg)}; compute {model_cfg.dtype}, "
                  f"params {model_cfg.param_dtype}, remat {remat}")
    console.print(
        f"mesh: {shape.flags} ({', '.join(f'{k}={v}' for k, v in shape.as_dict().items())}) on "
        f"{plural(n_devices, jax.devices()[0].platform + ' device')}; batch {cfg.batch_size} × seq {cfg.seq_len}, grad_accum {cfg.grad_accum}"
    )
    if strategy.name != "default" or rules:
        groups = ", ".join(f"layers {g.key}: {g.strategy.name}" for g in placement.groups)
        console.print(f"strategy: {strategy.name}" + (f" ({groups})" if groups else "")
                      + (f"; {plural(len(rules.rules), 'rule')} from {rules.path}" if rules else "")
                      + " — `meshlm explain` with the same flags shows every layout and collective")
    if pipeline is not None:
        console.print(f"pipeline: {pipeline.name}, {shape.pp} stages"
                      + (f" × {pipeline.virtual} virtual" if pipeline.virtual > 1 else "")
                      + f", {pipeline.microbatches} microbatches, {pipeline.clocks} clocks; bubble "
                      f"{pipeline.bubble():.1%} ((p-1)/(m·v+p-1) = {pipeline.theoretical_bubble():.1%}); "
                      f"at most {pipeline.act_slots} microbatch inputs stashed per stage")
    if jax.process_count() > 1:
        console.print(f"{plural(jax.process_count(), 'process')} × {plural(jax.local_device_count(), 'device')}; across hosts "
                      f"--dcn_mesh_dim={dcn} ({', '.join(f'{k}={v}' for k, v in dcn.as_dict().items() if v > 1)})")
    if eval_batches is not None:
        console.print(f"eval: {plural(eval_batches.n_batches, 'batch')} of {cfg.batch_size} rows from "
                      + (f"--eval_dataset={cfg.eval_dataset}" if cfg.eval_dataset else
                         f"--eval_split={cfg.eval_split}" + (f" ({plural(len(loader.held_out), 'row')} held out of "
                                                            f"training)" if loader.held_out is not None else
                                                            " (synthetic: random rows no training step draws)"))
                      + f", every {cfg.eval_every or max(1, cfg.steps // 10)} steps and after the last")
    if loader.chat_data is not None:
        console.print(loader.chat_data.describe(cfg.seq_len, loader.chat))
    if loader.steps_per_epoch:  # real data: how many times this run reads it
        console.print(f"data: a pass over the data (an epoch) is {plural(loader.steps_per_epoch, 'step')} of "
                      f"{cfg.batch_size} rows; --steps={cfg.steps} makes {cfg.steps / loader.steps_per_epoch:.3g} passes")
    schedule = {"lr": cfg.lr, "warmup_steps": warmup, "total_steps": schedule_steps, "min_lr_ratio": cfg.min_lr_ratio}
    run_meta = {"model": dataclasses.asdict(model_cfg), "mesh_dim": str(shape), "mesh": shape.flags, "seed": cfg.seed,
                "schedule": schedule, "train": cfg.as_flags()}
    if lora is not None:
        run_meta["lora"] = lora_meta(lora, init_source, cfg.seed)
        console.print(f"LoRA: rank {lora.spec.rank}, alpha {lora.spec.alpha:g} on {len(lora.targets)} weights "
                      f"({lora.n_params():,} trainable parameters); base frozen in {lora.spec.base_dtype}")
        if init_source is None:
            console.print("note: --lora_rank without --init_from: the frozen base is random weights (seed "
                          f"{cfg.seed}), so the adapters fine-tune nothing; give --init_from=MODEL for a real base")
    checkpointer = Checkpointer(out / "checkpoints", keep=cfg.keep, save_every=cfg.save_every)
    latest = checkpointer.latest_step()
    if latest is not None:
        target = checkpointed(abstract_state(placement, optimizer, lora), lora)
        state, data_state, saved_meta = checkpointer.restore(target, expect_meta=run_meta,
                                                             earlier_layouts=earlier_layouts(target))
        if lora is not None:
            state = with_base(state, frozen_base(placement, lora, init_source, cfg.seed))
        try:
            loader.restore(data_state)
        except UsageError as e:  # the data differs from the run's: name the run and the way out
            raise UsageError(f"{checkpointer.directory / str(latest)}: {e}; or give a new --output_dir to start a "
                             "fresh run") from None
        console.print(report.resumed(checkpointer.directory / str(latest), int(state.step), saved_meta, shape.flags))
        change = report.schedule_change(report.schedule_of(saved_meta), schedule, int(state.step), cfg.steps)
        if change:
            console.print(change)
    elif init_source is not None:
        from meshlm.checkpoint.weights import load_params

        state = train_state_from_params(placement, optimizer, load_params(init_source, placement), lora, cfg.seed)
        console.print(f"initialised from {init_source}")
    else:
        state = create_train_state(placement, optimizer, cfg.seed, lora)
    first_step = int(state.step) + 1
    step_fn = make_train_step(placement, optimizer, lr_schedule(opt_cfg), cfg.grad_accum, pipeline, lora)
    perm = sequence_permutation(placement, cfg.seq_len)
    evaluator = Evaluator(placement, eval_batches, perm) if eval_batches is not None else None
    eval_due = eval_steps(cfg.eval_every, cfg.steps)

    peak, peak_source = M.resolve_peak(cfg.peak_tflops, model_cfg.dtype)
    console.print(f"MFU peak: {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
    logger = M.MetricsLogger(
        out, flops_per_token=model_flops_per_token(model_cfg, cfg.seq_len), peak_flops_per_device=peak,
        n_devices=n_devices, total_steps=cfg.steps, log_every=cfg.log_every, enabled=is_main,
        tracker=cfg.tracker, run_config=run_meta,
    )
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(run_meta, indent=2, default=str))
        if hasattr(tokenizer, "path"):
            tokenizer.save(out / "tokenizer")
            if loader.chat_data is not None:  # served as it was trained
                loader.chat_data.save_template(out / "tokenizer")

    tokens_per_step = cfg.batch_size * cfg.seq_len
    history: list[dict] = []
    evals: list[dict] = []
    compile_s = None
    stop = StopRequest()
    saved_at = first_step - 1
    watch, diverged = NonFiniteWatch(model_cfg.vocab_size), None  # the first NaN/Inf loss or gradient norm ends the run
    watch.start(first_step, state.params)  # what it says of the cause needs the weights the run starts from
    profiler = StepProfiler(profile_range(cfg.profile_steps) if cfg.profile_steps else None, out / "profile", is_main)
    documents = DocumentsWatch(model_cfg, cfg.seq_len, ring=shape.sp > 1, platform=jax.devices()[0].platform,
                               gpu_capability=gpu_capability())  # fmt: skip
    with stop, logger.closed_on_error(), M.TrainProgress(cfg.steps, enabled=is_main, console=console) as progress:
        t_last, tokens_since = time.perf_counter(), 0
        for step in range(first_step, cfg.steps + 1):
            host_batch = next(loader)
            if (warning := documents.check(host_batch)) and is_main:
                console.print(warning)
            batch = put_batch(placement, host_batch, perm)
            if line := profiler.before(step, first_step):
                console.print(line)
            t0 = time.perf_counter()
            state, step_metrics = step_fn(state, batch)
            watch.observe(step, step_metrics, host_batch)  # on the device: no host sync; the batch's ids on the host
            tokens_since += tokens_per_step
            if step == first_step:
                jax.block_until_ready(step_metrics)
                compile_s = time.perf_counter() - t0
                t_last, tokens_since = time.perf_counter(), 0  # throughput excludes the compile
                console.print(f"compiled and ran step {step} in {compile_s:.1f}s")
            if step % cfg.log_every == 0 or step == cfg.steps:
                host = jax.device_get(step_metrics)  # the only host sync: once per log step
                now = time.perf_counter()
                first = step == first_step  # its time is the compile: throughput is honest, not useful
                row = logger.log(
                    step, loss=float(host["loss"]), tokens=tokens_per_step if first else tokens_since,
                    seconds=compile_s if first else max(now - t_last, 1e-9),
                    extra={"lr": float(host.get("lr", 0.0)), "grad_norm": float(host["grad_norm"])},
                )
                history.append(row)
                if is_main:
                    M.print_metrics_line(row, console=console)
                t_last, tokens_since = now, 0
                progress.update(step, row)
            else:
                progress.update(step, None)
            if line := profiler.after(step, state):
                console.print(line)
            saving = checkpointer.should_save(step) or stop.requested or step == cfg.steps
            if (saving or step % cfg.log_every == 0) and (diverged := watch.check(step, state.params if saving else None)):
                console.print(report.diverged(diverged, saved_at if saved_at >= 1 else None, out))
                break  # nothing more is saved: the newest checkpoint is the last good one
            if evaluator is not None and eval_due(step) and not stop.requested:
                jax.block_until_ready(state.params)  # the train steps' time stays theirs ...
                t_eval = time.perf_counter()
                result = logger.log_eval(step, evaluator(eval_params(state.params, lora)))
                evals.append(result)
                if is_main:
                    M.print_metrics_line(result, console=console)
                t_last += time.perf_counter() - t_eval  # ... and the evaluation's is left out of tok/s
            if checkpointer.should_save(step) or stop.requested or step == cfg.steps:
                checkpointer.save(step, checkpointed(state, lora), loader.state(), run_meta)
                saved_at = step
            if stop.requested:
                break
    if line := profiler.close():
        console.print(line)
    checkpointer.close()  # waits for the last asynchronous save
    logger.close(title=f"{cfg.model or init_source or 'tiny'} on {shape.flags}")
    last_step = saved_at
    summary = {
        "interrupted": stop.requested,
        "diverged": diverged.step if diverged else None,
        "already_done": False,
        "checkpoint_step": saved_at,
        "first_step": first_step,
        "last_step": last_step,
        "steps_run": last_step - first_step + 1,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "compile_seconds": compile_s,
        "steps": cfg.steps,
        "mesh_dim": str(shape),
        "output_dir": str(out),
        "history": history,
        "evals": evals,
    }
    if is_main and not diverged:
        for line in report.summary_lines(
            first_step=first_step, last_step=last_step, total_steps=cfg.steps, history=history, evals=evals,
            stopped=stop.requested, output_dir=cfg.output_dir,
            checkpoint=out / "checkpoints" / str(saved_at) if saved_at >= first_step else None,
            chat=loader.chat_data is not None,
        ):
            console.print(line)
    return summary
