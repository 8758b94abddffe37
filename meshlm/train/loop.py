"""`meshlm train`: the training loop over the library pieces (mesh, placement, state, step, data, metrics).

`TrainConfig` is the single list of training flags: the CLI builds its parser from these fields and
their help texts, and Python users construct it directly and call `train(cfg)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlm.errors import UsageError


def _flag(default, help: str, **kw):
    if default is dict:
        return field(default_factory=dict, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    mesh_dim: str | None = _flag(None, "dp,fsdp,tp,sp sizes, e.g. 1,8,1,1 or fsdp:-1,tp:2; one may be -1 (default: all fsdp)")
    mp_mesh_dim: str | None = _flag(None, "EasyLM form: model-parallel sizes tp,sp only; data parallelism is inferred")
    fsdp: bool = _flag(False, "with --mp_mesh_dim: shard parameters over the data axis too (fsdp instead of dp)")
    pp: int = _flag(1, "pipeline stages: the layers split over pp groups of devices (also pp:N in --mesh_dim); devices = pp × dp × fsdp × tp × sp")
    pipeline_schedule: str = _flag("1f1b", "with --pp: gpipe, 1f1b (memory bounded by 2·pp microbatches) or interleaved (with --virtual_stages)")
    microbatches: int | None = _flag(None, "with --pp: microbatches per step (default: 2·pp); the batch splits into them")
    virtual_stages: int = _flag(1, "with --pipeline_schedule=interleaved: stages per device (the bubble shrinks by this much)")
    strategy: str = _flag("default", "sharding preset: default, dp, fsdp, fsdp_tp, megatron, megatron_sp, fsdp_sp (tables in docs/strategies.md)")
    zero_stage: int | None = _flag(None, "ZeRO over the axes the batch splits over: 0 replicate all, 1 shard optimizer state, 2 and gradients (reduce-scatter), 3 and parameters (default: as the preset says)")
    sharding_rules: str | None = _flag(None, "TOML file of overrides over the preset: [logical] axes, [[rules]] regex on parameter paths -> spec, [[layers]] ranges -> preset")
    devices: int | None = _flag(None, "simulate N CPU devices (sets XLA's host device count; CPU only; per process)")
    dcn_mesh_dim: str | None = _flag(None, "several hosts: how many ways each of dp,fsdp,tp,sp is split across hosts; --mesh_dim is then one host's share (default: --mesh_dim is the whole mesh, hosts over dp, then fsdp)")
    coordinator_address: str | None = _flag(None, "several processes: HOST:PORT of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS, or the cluster's own, e.g. SLURM)")
    num_processes: int | None = _flag(None, "several processes: how many (default: $JAX_NUM_PROCESSES, or 1)")
    process_id: int | None = _flag(None, "several processes: this one's rank, 0 .. num_processes-1 (default: $JAX_PROCESS_ID)")
    peer_timeout: float = _flag(20.0, "several processes: stop when another process is silent for this many seconds")
    connect_timeout: float = _flag(120.0, "several processes: how long to wait for the coordinator at start-up, in seconds")
    model: str | None = _flag(None, "preset name or path of a Hugging Face config.json (default: tiny, or the --init_from model); fields via --model.FIELD=VALUE")
    init_from: str | None = _flag(None, "start from these weights: hf:DIR (a Hugging Face LLaMA folder) or a meshlm convert/export folder")
    model_overrides: dict = _flag(dict, "set by --model.FIELD=VALUE", cli=False)
    steps: int = _flag(200, "optimizer steps to take (steps count from 1)")
    batch_size: int = _flag(8, "global batch size in sequences (all devices, all micro-batches)")
    seq_len: int = _flag(256, "tokens per sequence")
    grad_accum: int = _flag(1, "micro-batches per step (gradient accumulation)")
    lr: float = _flag(3e-4, "peak learning rate")
    warmup_steps: int | None = _flag(None, "linear warm-up steps (default: 10%% of --steps, at most 1000)")
    min_lr_ratio: float = _flag(0.1, "cosine decay ends at lr × this")
    weight_decay: float = _flag(0.1, "AdamW weight decay (never applied to norm scales)")
    clip_norm: float = _flag(1.0, "global gradient-norm clip; 0 disables")
    dtype: str = _flag("auto", "compute dtype: auto (float32 on CPU, where it is fastest; bfloat16 on GPU/TPU), float32, bfloat16")
    param_dtype: str = _flag("float32", "parameter and optimizer-state dtype")
    remat: str = _flag("none", "rematerialisation policy: none, full, save_dots, save_qkv_attn")
    dataset: str = _flag("stdlib", "stdlib (Python's own sources), synthetic, a .txt/.jsonl file, folder or glob, or hf:NAME[:split]")
    tokenizer: str | None = _flag(None, "tokenizer.json or a folder holding one (default: BPE trained on the dataset and cached)")
    output_dir: str = _flag("outputs/train", "where metrics.jsonl, TensorBoard events and loss.png go")
    log_every: int = _flag(10, "log loss, tokens/s, TFLOP/s per device and MFU every N steps")
    seed: int = _flag(0, "seed for parameters and data order")
    save_every: int = _flag(0, "save a checkpoint every N steps (0: only at the end); re-running resumes from the newest")
    keep: int = _flag(3, "how many of the newest checkpoints to keep")
    peak_tflops: float | None = _flag(None, "peak TFLOP/s per device for MFU (default: built-in table, or a matmul probe on CPU)")

    def validate(self) -> None:
        if self.save_every < 0 or self.keep <= 0:
            raise UsageError("--save_every must be ≥ 0 and --keep ≥ 1")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--{name}={getattr(self, name)} must be a positive integer")
        if self.devices is not None and self.devices <= 0:
            raise UsageError(f"--devices={self.devices} must be a positive integer")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UsageError(f"--dtype={self.dtype}: choose auto, float32 or bfloat16")
        if self.param_dtype not in ("float32", "bfloat16"):
            raise UsageError(f"--param_dtype={self.param_dtype}: choose float32 or bfloat16")
        if self.batch_size % self.grad_accum:
            raise UsageError(f"--batch_size={self.batch_size} is not divisible by --grad_accum={self.grad_accum}")


def pipeline_schedule(cfg: TrainConfig, shape, n_layers: int):
    """The `--pp` flags checked (one line each, before anything compiles) and the schedule they give."""
    from meshlm.ops.pipeline import build_schedule, check

    micro = cfg.microbatches or 2 * shape.pp
    check(cfg.pipeline_schedule, shape.pp, micro, cfg.virtual_stages, n_layers)
    if cfg.grad_accum > 1:
        raise UsageError("--grad_accum with --pp: the pipeline's --microbatches already accumulate; drop --grad_accum")
    if cfg.batch_size % (micro * shape.data):
        raise UsageError(f"--batch_size={cfg.batch_size} does not split into --microbatches={micro} of rows "
                         f"divisible by dp×fsdp = {shape.data}; use a multiple of {micro * shape.data}")
    return build_schedule(cfg.pipeline_schedule, shape.pp, micro, cfg.virtual_stages)


def choose_strategy(cfg: TrainConfig, shape, n_layers: int, pipelined: bool = False):
    """(strategy, rules) from --strategy, --zero_stage and --sharding_rules, checked against the mesh
    and the batch before anything compiles."""
    from meshlm.sharding import as_tuple
    from meshlm.strategy import choose

    strategy, rules = choose(cfg.strategy, cfg.zero_stage, cfg.sharding_rules)
    if rules and rules.layers and pipelined:
        raise UsageError(f"{cfg.sharding_rules}: [[layers]] ranges with --pp: the pipeline stages already split "
                         "the layers; drop one of them")
    sizes = shape.as_dict()
    rows = cfg.batch_size // cfg.grad_accum
    for s in (strategy, *(r.strategy for r in (rules.layers if rules else ()))):
        axes = [a for a in as_tuple(s.activations.get("batch")) if sizes.get(a, 1) > 1]
        ways = math.prod(sizes[a] for a in axes)
        if rows % ways:
            raise UsageError(f"--strategy={s.name.split('+')[0]} splits the batch over {'×'.join(axes)} = {ways} devices "
                             f"but a step has {rows} rows; use a --batch_size that is a multiple of {ways * cfg.grad_accum}")
    return strategy, rules


def configure_devices(devices: int | None) -> None:
    """`--devices=N`: N simulated CPU devices. Must run before JAX initialises its backends."""
    import os

    if devices is None:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


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


def resolve_dtype(dtype: str) -> str:
    import jax

    if dtype != "auto":
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def train(cfg: TrainConfig, console=None) -> dict[str, Any]:
    """Run a training job end to end; returns a summary (first and last loss, throughput, paths)."""
    cfg.validate()
    configure_devices(cfg.devices)
    from meshlm import distributed

    cluster = distributed.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.peer_timeout)
    distributed.initialize(cluster, connect_timeout=cfg.connect_timeout)
    if not cluster.multi_process:
        return _train(cfg, console)
    try:
        summary = _train(cfg, console)
    except UsageError as e:  # the others would wait for this one in a collective: leave now, status 2
        print(f"error: process {cluster.process_id}: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except Exception as e:  # noqa: BLE001  (a collective failing under us: usually a peer died)
        distributed.fail_fast(e)
    distributed.finish()
    return summary


def _train(cfg: TrainConfig, console) -> dict[str, Any]:
    import jax
    from rich.console import Console

    from meshlm import data, mesh as meshlib
    from meshlm.checkpoint.manager import Checkpointer
    from meshlm.models.configs import apply_overrides, describe, resolve_model
    from meshlm.models.placement import place
    from meshlm.train import metrics as M
    from meshlm.train.optimizer import OptimizerConfig, lr_schedule, make_optimizer
    from meshlm.train.state import abstract_state, create_train_state, train_state_from_params
    from meshlm.train.step import make_train_step, put_batch, sequence_permutation

    is_main = jax.process_index() == 0  # logs, progress and files come from process 0 only
    console = console or Console(quiet=not is_main)
    init_source = None
    if cfg.init_from:
        from meshlm.checkpoint.hf import parse_init_from, read_model_config

        init_source = parse_init_from(cfg.init_from)
    if cfg.model or init_source is None:
        model_cfg = resolve_model(cfg.model or "tiny", cfg.model_overrides)
    else:
        model_cfg = apply_overrides(read_model_config(init_source), cfg.model_overrides)
    model_cfg = model_cfg.replace(dtype=resolve_dtype(cfg.dtype), param_dtype=cfg.param_dtype, remat=cfg.remat)
    tokenizer_spec = cfg.tokenizer
    if tokenizer_spec is None and init_source is not None:
        found = [d for d in (init_source, init_source / "tokenizer") if (d / "tokenizer.json").is_file()]
        tokenizer_spec = str(found[0]) if found else None
    n_devices = jax.device_count()
    shape, dcn = meshlib.resolve_hybrid(cfg.mesh_dim, cfg.mp_mesh_dim, cfg.fsdp, cfg.dcn_mesh_dim, n_devices,
                                        jax.process_count(), cfg.pp)
    pipeline = pipeline_schedule(cfg, shape, model_cfg.n_layers) if shape.pp > 1 else None
    if cfg.mp_mesh_dim:
        console.print(f"--mp_mesh_dim={cfg.mp_mesh_dim}{' --fsdp' if cfg.fsdp else ''} is --mesh_dim={shape}")
    meshlib.validate_mesh_shape(
        shape, batch_size=cfg.batch_size, seq_len=cfg.seq_len, n_heads=model_cfg.n_heads,
        n_kv_heads=model_cfg.n_kv_heads, mlp_dim=model_cfg.mlp_dim, vocab_size=model_cfg.vocab_size,
    )
    if (cfg.batch_size // cfg.grad_accum) % shape.data:
        raise UsageError(
            f"--batch_size={cfg.batch_size} / --grad_accum={cfg.grad_accum} = {cfg.batch_size // cfg.grad_accum} "
            f"rows per micro-batch is not divisible by dp×fsdp = {shape.data}"
        )
    if cfg.seq_len > model_cfg.max_seq_len:
        raise UsageError(f"--seq_len={cfg.seq_len} exceeds the model's max_seq_len={model_cfg.max_seq_len}; "
                         "raise --model.max_seq_len or shorten --seq_len")

    # The strategy and every parameter's layout are checked before any data is read.
    strategy, rules = choose_strategy(cfg, shape, model_cfg.n_layers, pipeline is not None)
    if init_source is not None and rules and rules.layers:
        raise UsageError("--init_from with [[layers]] ranges is not supported yet; start from scratch or drop [[layers]]")
    mesh = meshlib.build_mesh(shape, dcn=dcn)
    placement = place(model_cfg, mesh, strategy, rules)
    tokenizer = data.load_tokenizer(tokenizer_spec, cfg.dataset, model_cfg.vocab_size)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise UsageError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_cfg.vocab_size}; "
            f"set --model.vocab_size={tokenizer.vocab_size} (rounded up to a multiple of tp)"
        )
    loader = data.make_loader(
        cfg.dataset, tokenizer, cfg.seq_len, cfg.batch_size,
        process_index=jax.process_index(), process_count=jax.process_count(), seed=cfg.seed,
    )

    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(1000, cfg.steps // 10)
    opt_cfg = OptimizerConfig(
        lr=cfg.lr, warmup_steps=warmup, total_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio,
        weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm,
    )
    optimizer = make_optimizer(opt_cfg)
    console.print(f"model: {cfg.model or init_source or 'tiny'} — {describe(model_cfg)}; compute {model_cfg.dtype}, params {model_cfg.param_dtype}")
    console.print(
        f"mesh: {shape.flags} ({', '.join(f'{k}={v}' for k, v in shape.as_dict().items())}) on {n_devices} "
        f"{jax.devices()[0].platform} device(s); batch {cfg.batch_size} × seq {cfg.seq_len}, grad_accum {cfg.grad_accum}"
    )
    if strategy.name != "default" or rules:
        groups = ", ".join(f"layers {g.key}: {g.strategy.name}" for g in placement.groups)
        console.print(f"strategy: {strategy.name}" + (f" ({groups})" if groups else "")
                      + (f"; {len(rules.rules)} rule(s) from {rules.path}" if rules else "")
                      + " — `meshlm explain` with the same flags shows every layout and collective")
    if pipeline is not None:
        console.print(f"pipeline: {pipeline.name}, {shape.pp} stages"
                      + (f" × {pipeline.virtual} virtual" if pipeline.virtual > 1 else "")
                      + f", {pipeline.microbatches} microbatches, {pipeline.clocks} clocks; bubble "
                      f"{pipeline.bubble():.1%} ((p-1)/(m·v+p-1) = {pipeline.theoretical_bubble():.1%}); "
                      f"at most {pipeline.act_slots} microbatch inputs stashed per stage")
    if jax.process_count() > 1:
        console.print(f"{jax.process_count()} processes × {jax.local_device_count()} devices; across hosts "
                      f"--dcn_mesh_dim={dcn} ({', '.join(f'{k}={v}' for k, v in dcn.as_dict().items() if v > 1)})")
    out = Path(cfg.output_dir)
    run_meta = {"model": dataclasses.asdict(model_cfg), "mesh_dim": str(shape), "seed": cfg.seed,
                "train": dataclasses.asdict(cfg)}
    checkpointer = Checkpointer(out / "checkpoints", keep=cfg.keep, save_every=cfg.save_every)
    if checkpointer.latest_step() is not None:
        state, data_state, _ = checkpointer.restore(abstract_state(placement, optimizer), expect_meta=run_meta)
        loader.restore(data_state)
        console.print(f"resumed from {checkpointer.directory / str(checkpointer.latest_step())} at step {int(state.step)}")
    elif init_source is not None:
        from meshlm.checkpoint.hf import load_params

        state = train_state_from_params(placement, optimizer, load_params(init_source, placement))
        console.print(f"initialised from {init_source}")
    else:
        state = create_train_state(placement, optimizer, cfg.seed)
    first_step = int(state.step) + 1
    step_fn = make_train_step(placement, optimizer, lr_schedule(opt_cfg), cfg.grad_accum, pipeline)
    perm = sequence_permutation(placement, cfg.seq_len)

    peak, peak_source = M.resolve_peak(cfg.peak_tflops, model_cfg.dtype)
    console.print(f"MFU peak: {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
    logger = M.MetricsLogger(
        out, flops_per_token=M.model_flops_per_token(model_cfg, cfg.seq_len), peak_flops_per_device=peak,
        n_devices=n_devices, total_steps=cfg.steps, log_every=cfg.log_every, enabled=is_main,
    )
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(run_meta, indent=2, default=str))
        if hasattr(tokenizer, "path"):
            tokenizer.save(out / "tokenizer")

    tokens_per_step = cfg.batch_size * cfg.seq_len
    history: list[dict] = []
    compile_s = None
    stop = StopRequest()
    saved_at = first_step - 1
    with stop, M.TrainProgress(cfg.steps, enabled=is_main) as progress:
        t_last, tokens_since = time.perf_counter(), 0
        for step in range(first_step, cfg.steps + 1):
            batch = put_batch(placement, next(loader), perm)
            t0 = time.perf_counter()
            state, step_metrics = step_fn(state, batch)
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
            if checkpointer.should_save(step) or stop.requested or step == cfg.steps:
                checkpointer.save(step, state, loader.state(), run_meta)
                saved_at = step
            if stop.requested:
                break
    checkpointer.close()  # waits for the last asynchronous save
    logger.close(title=f"{cfg.model or init_source or 'tiny'} on {shape.flags}")
    if stop.requested:
        console.print(f"received {stop.requested}: saved a checkpoint at step {saved_at} in "
                      f"{checkpointer.directory / str(saved_at)}; run the same command to resume")
    summary = {
        "interrupted": stop.requested,
        "checkpoint_step": saved_at,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "compile_seconds": compile_s,
        "steps": cfg.steps,
        "mesh_dim": str(shape),
        "output_dir": str(out),
        "history": history,
    }
    if is_main and history:
        console.print(
            f"done: loss {summary['first_loss']:.3f} → {summary['final_loss']:.3f} over {cfg.steps} steps; "
            f"metrics in {out / 'metrics.jsonl'}, curve in {out / 'loss.png'}, TensorBoard in {out / 'tb'}"
        )
    return summary
