"""The job layer: flags in, a model placed on a mesh out, every pre-compile check run once.

Every command goes through here: `meshlm train` and `meshlm explain` call `resolve`, `meshlm plan`
calls `resolve_model`, `pipeline_schedule` and `check_mesh` for the meshes it names, and
`meshlm generate` / `meshlm serve` call `resolve_serving`. The same bad input therefore gives the
same one-line `UsageError` from every command, before any weights are read or anything compiles.

    job = resolve(TrainConfig(model="tiny", mesh_dim="1,8,1,1"))
    job.placement.init(seed=0)          # parameters laid out on job.mesh by job.strategy
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlm import mesh as meshlib
from meshlm.config import TrainConfig, check_dtype
from meshlm.errors import UsageError, closest
from meshlm.mesh import MeshShape
from meshlm.models.configs import ModelConfig
from meshlm.models.policy import RunPolicy

# The longest KV cache serving allocates unless --max_seq_len asks for more.
SERVING_CONTEXT = 2048


@dataclass
class Job:
    """What the commands share once the flags are resolved. `mesh` and `placement` are None when the
    job was resolved without building them (`build=False`)."""

    model: ModelConfig  # what the model is
    policy: RunPolicy  # how the run runs it: dtype, param_dtype and remat filled in
    shape: MeshShape
    dcn: MeshShape | None  # how the mesh is split across hosts (None: one process)
    pipeline: Any  # meshlm.ops.pipeline.Schedule, or None without --pp
    strategy: Any  # meshlm.sharding.Strategy
    rules: Any  # meshlm.strategy.rules.Rules, or None
    init_source: Path | None = None  # --init_from, resolved
    mesh: Any = None  # jax.sharding.Mesh
    placement: Any = None  # meshlm.models.placement.Placement


# ------------------------------------------------------------------------------------ the model


def resolve_model(cfg: TrainConfig) -> tuple[ModelConfig, Path | None]:
    """(model config, --init_from source) from --model, the model's --model.FIELD overrides and
    --init_from. Checks --seq_len against the model's context."""
    from meshlm.models.configs import apply_overrides
    from meshlm.models.policy import split_overrides
    from meshlm.models.presets import resolve_model as preset_or_config

    overrides = split_overrides(cfg.model_overrides)[0]
    init_source = None
    if cfg.init_from:
        from meshlm.checkpoint.weights import parse_init_from, read_model_config

        init_source = parse_init_from(cfg.init_from)
    if cfg.model:
        cfg.model = preset_name(cfg.model)  # `Tiny` is tiny, in the logs and the saved run config too
    if cfg.model or init_source is None:
        model = preset_or_config(cfg.model or "tiny", overrides)
    else:
        model = apply_overrides(read_model_config(init_source), overrides)
    check_context(cfg.seq_len, model)
    return model, init_source


def resolve_policy(cfg: TrainConfig, backend: str | None = None) -> RunPolicy:
    """How the run runs its model, from the precision flags, --remat, --attention and the policy's
    --model.FIELD overrides (`meshlm.models.policy.OVERRIDES`); `auto` dtype for `backend` (default:
    the one JAX runs on)."""
    from meshlm.models import policy
    from meshlm.platform import resolve_dtype

    cfg.section("precision").check()
    base = RunPolicy(
        dtype=resolve_dtype(cfg.dtype, backend), param_dtype=cfg.param_dtype, remat=cfg.remat, attention=cfg.attention
    )
    return policy.apply_overrides(base, policy.split_overrides(cfg.model_overrides)[1])


def preset_name(name: str) -> str:
    """--model as given, or the preset it names in another case (`Tiny`); a near miss of a preset
    (`llama3-8`) that is no file is one line asking whether the preset was meant."""
    from meshlm.models.presets import PRESETS

    if name in PRESETS or Path(name).suffix == ".json" or Path(name).exists():
        return name
    by_lower = {p.lower(): p for p in PRESETS}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    if close := closest(name.lower(), by_lower, cutoff=0.6):
        raise UsageError(
            f"--model={name!r} is neither a preset nor a config.json path; did you mean --model={by_lower[close]}?"
        )
    return name  # the preset table's own error lists every preset


def check_context(seq_len: int, model: ModelConfig) -> None:
    if seq_len > model.max_seq_len:
        raise UsageError(
            f"--seq_len={seq_len} exceeds the model's max_seq_len={model.max_seq_len}; "
            "raise --model.max_seq_len or shorten --seq_len"
        )


# ------------------------------------------------------------------------------------ the mesh


def pipeline_schedule(cfg: TrainConfig, shape: MeshShape, n_layers: int):
    """The `--pp` flags checked (one line each, before anything compiles) and the schedule they give."""
    from meshlm.ops.pipeline import schedule_for_job

    return schedule_for_job(
        cfg.pipeline_schedule,
        shape.pp,
        cfg.microbatches,
        cfg.virtual_stages,
        n_layers,
        cfg.batch_size,
        cfg.grad_accum,
        shape.data,
    )


def device_memory(device=None) -> tuple[float | None, str]:
    """(bytes one device may use, whose memory that is, in words): on CPU the host's memory less the
    operating system's share (`meshlm.plan.hardware.host_memory_budget`) over this process's simulated
    devices, which share it; elsewhere what JAX's client reports (None where it says nothing)."""
    import jax

    from meshlm.plan.hardware import device_memory_budget, host_memory_budget, host_memory_bytes

    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        n = jax.local_device_count()
        return host_memory_budget() / n, (
            f"this host's {host_memory_bytes() / 2**30:.1f} GiB of memory leaves each "
            f"of its {n} simulated device(s) after the operating system's share"
        )
    return device_memory_budget(device), f"JAX may use of one {device.device_kind}"


def memory_compiler(device) -> str:
    """Whose buffer assignment the memory model takes for `device` (`meshlm.plan.memory.compiler_for`)."""
    from meshlm.plan.memory import compiler_for

    return "gpu" if device.platform == "gpu" else compiler_for(device.device_kind)


def pipeline_flags(cfg: TrainConfig):
    """The pipeline flags as the planner takes them (`meshlm.plan.job.PipelineFlags`)."""
    from meshlm.plan.job import PipelineFlags

    return PipelineFlags(cfg.pipeline_schedule, cfg.microbatches, cfg.virtual_stages)


def plan_job(cfg: TrainConfig, model: ModelConfig, policy: RunPolicy, devices: MeshShape | int):
    """This job as `meshlm plan` sees it (`meshlm.plan.job.Job`), on a mesh or a number of devices."""
    from meshlm.plan.job import Job as PlanJob

    n_devices = devices if isinstance(devices, int) else devices.n_devices
    return PlanJob(model, cfg.batch_size, cfg.seq_len, n_devices, cfg.grad_accum, pipeline_flags(cfg), policy)


def auto_remat(cfg: TrainConfig, model: ModelConfig, policy: RunPolicy, shape: MeshShape, device=None) -> str:
    """What `--remat=auto` means for this job on this mesh (`meshlm.plan.fit.auto_policy`, which
    `meshlm plan --hardware=cpu` calls too).

    CPU: `none` where the step's scratch with every activation kept stays in one block the host's
    allocator keeps between steps (`meshlm.platform.keep_host_memory`, `KEPT_BLOCK_BYTES`), else
    `save_qkv_attn` (else `full`) while its predicted peak fits the host's memory share. A larger
    scratch is mapped and faulted in anew every step, so keeping the MLP's activations then costs more
    than recomputing them; XLA:CPU also zero-fills the layer loop's saved activations and copies them
    again before the backward reads them (`meshlm.plan.cost.RESIDUAL_PASSES`). `bench/remat_cpu.py`
    times the policies.
    GPU and TPU: the least recomputation whose peak, as `meshlm plan` predicts it, fits what JAX may use
    of one device (`meshlm.plan.remat.first_fitting`)."""
    import jax

    from meshlm.backends import profile_for
    from meshlm.plan.fit import auto_policy

    device = device or jax.local_devices()[0]
    budget, _ = device_memory(device)
    if not budget:
        return "none"
    kept = profile_for(device.platform).kept_block_bytes()
    return auto_policy(plan_job(cfg, model, policy, shape), shape, budget, memory_compiler(device), kept)


def check_auto_remat(cfg: TrainConfig) -> None:
    """`--remat=auto` named on the command line needs the memory model's prediction, which holds for the
    one layout it models (`meshlm.plan.job.PLANNED_STRATEGY`, no --zero_stage or --sharding_rules): one
    line otherwise. Left at its default, auto keeps choosing from that model's prediction."""
    from meshlm.plan.job import PLANNED_STRATEGY

    if cfg.remat != "auto" or "remat" not in cfg.given:
        return
    given = {"strategy": cfg.strategy, "zero_stage": cfg.zero_stage, "sharding_rules": cfg.sharding_rules}
    other = [f"--{name}={value}" for name, value in given.items() if value is not None and value != PLANNED_STRATEGY]
    if other:
        raise UsageError(
            f"--remat=auto with {' '.join(other)}: the memory model that chooses it plans only "
            f"--strategy={PLANNED_STRATEGY}; name a policy instead, e.g. --remat=save_qkv_attn "
            f"(or --remat=full)"
        )


MEMORY_CHECK = "MESHLM_MEMORY_CHECK"  # 0: run a job the memory model predicts not to fit


def memory_check_off() -> bool:
    import os

    return os.environ.get(MEMORY_CHECK, "").strip().lower() in ("0", "false", "no", "off")


def check_memory(cfg: TrainConfig, model: ModelConfig, policy: RunPolicy, shape: MeshShape, device=None) -> None:
    """One line, before anything compiles, when the job's predicted peak (`meshlm plan`'s memory model)
    exceeds what a device may use (`device_memory`), naming the nearest change that fits. Skipped with
    MESHLM_MEMORY_CHECK=0, and for LoRA runs (the model counts every weight's gradient and moments)."""
    import jax

    from meshlm.plan.fit import misfit

    if memory_check_off() or cfg.lora_rank:
        return
    device = device or jax.local_devices()[0]
    budget, where = device_memory(device)
    if not budget:
        return
    if cfg.remat == "auto":  # what auto chose was the least it could: changes keep auto choosing
        policy = policy.replace(remat="auto")
    problem = misfit(plan_job(cfg, model, policy, shape), shape, budget, memory_compiler(device), where)
    if problem:
        raise UsageError(f"{problem} ({MEMORY_CHECK}=0 runs it anyway)")


def check_mesh(cfg: TrainConfig, shape: MeshShape, model: ModelConfig) -> None:
    """The mesh against the job: batch, sequence and model dimensions divide as the axes need."""
    meshlib.validate_mesh_shape(
        shape,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        mlp_dim=model.mlp_dim,
        vocab_size=model.vocab_size,
    )
    if (cfg.batch_size // cfg.grad_accum) % shape.data:
        raise UsageError(
            f"--batch_size={cfg.batch_size} / --grad_accum={cfg.grad_accum} = {cfg.batch_size // cfg.grad_accum} "
            f"rows per micro-batch is not divisible by dp×fsdp = {shape.data}"
        )
    stage = model.n_layers // (shape.pp * (cfg.virtual_stages or 1))
    if shape.pp > 1 and stage % model.pattern_period:
        raise UsageError(
            f"--pp={shape.pp} --virtual_stages={cfg.virtual_stages or 1}: a stage of {stage} layers is not whole "
            f"repeats of --model.layer_pattern={model.layer_pattern} ({model.pattern_period} layers); choose them "
            f"so that n_layers={model.n_layers} / (pp × virtual_stages) is a multiple of {model.pattern_period}"
        )


def check_kernel(model: ModelConfig, policy: RunPolicy, seq_len: int) -> None:
    """A forced `--attention` kernel against the devices JAX runs on, before anything starts: the kernel's
    platform, the compute dtype and head_dim it needs, the local layers' window and the logit soft cap
    (packed documents on older GPUs are found when the first batch is traced). `auto`, `dense` and `blockwise` run anywhere."""
    from meshlm.ops import kernels

    if policy.attention in ("auto", "dense", "blockwise"):
        return
    call = kernels.Call(
        platform=kernels.default_platform(),
        q_len=seq_len,
        kv_len=seq_len,
        head_dim=model.head_dim,
        dtype=policy.dtype,
        packed=False,
        causal=True,
        gpu_capability=kernels.gpu_capability(),
        softcap=model.attn_logit_softcap,
    )
    # Each kind of layer the model has (global, and local with its window) must be served.
    for window in sorted({model.sliding_window if local else 0 for local in model.local_layers}):
        kernels.choose(policy.attention, call._replace(window=window))  # one UsageError line when it cannot


def choose_strategy(cfg: TrainConfig, shape: MeshShape, pipelined: bool = False):
    """(strategy, rules) from --strategy, --zero_stage and --sharding_rules, checked against the mesh
    and the batch."""
    from meshlm.sharding import as_tuple
    from meshlm.strategy import check_pipelined, choose

    strategy, rules = choose(cfg.strategy, cfg.zero_stage, cfg.sharding_rules)
    check_pipelined(strategy, shape.as_dict(), pipelined)
    if rules and rules.layers and pipelined:
        raise UsageError(
            f"{cfg.sharding_rules}: [[layers]] ranges with --pp: the pipeline stages already split "
            "the layers; drop one of them"
        )
    sizes = shape.as_dict()
    rows = cfg.batch_size // cfg.grad_accum
    for s in (strategy, *(r.strategy for r in (rules.layers if rules else ()))):
        axes = [a for a in as_tuple(s.activations.get("batch")) if sizes.get(a, 1) > 1]
        ways = math.prod(sizes[a] for a in axes)
        if rows % ways:
            raise UsageError(
                f"--strategy={s.name.split('+')[0]} splits the batch over {'×'.join(axes)} = {ways} devices "
                f"but a step has {rows} rows; use a --batch_size that is a multiple of {ways * cfg.grad_accum}"
            )
    return strategy, rules


# ------------------------------------------------------------------------------------ whole jobs


def check_output(cfg: TrainConfig, model: ModelConfig) -> None:
    """--output_dir can hold the run (a folder, not a file or under one), and a checkpoint already in
    it was saved by this model: found before the tokenizer, the data or anything compiles."""
    import dataclasses

    from meshlm.checkpoint.folders import check_writable_folder

    check_writable_folder(cfg.output_dir, "--output_dir")
    if (Path(cfg.output_dir).expanduser() / "checkpoints").is_dir():
        from meshlm.checkpoint.manager import check_run_folder

        check_run_folder(cfg.output_dir, dataclasses.asdict(model))


def resolve(cfg: TrainConfig, *, build: bool = True, output: bool = True) -> Job:
    """A training job from its flags on the devices JAX has (all processes'), in this order: model, mesh
    shape and pipeline, strategy, remat; with `output`, --output_dir and the checkpoint in it (`check_output`); with
    `build`, the mesh and the placement too. Raises UsageError."""
    import jax

    cfg.validate()
    policy = resolve_policy(cfg)
    model, init_source = resolve_model(cfg)
    # The checks that read nothing first, then the run folder and the checkpoint in it.
    shape, dcn = meshlib.resolve_hybrid(
        cfg.mesh_dim, cfg.mp_mesh_dim, cfg.fsdp, cfg.dcn_mesh_dim, jax.device_count(), jax.process_count(), cfg.pp
    )
    pipeline = pipeline_schedule(cfg, shape, model.n_layers) if shape.pp > 1 else None
    check_mesh(cfg, shape, model)
    strategy, rules = choose_strategy(cfg, shape, pipeline is not None)
    if init_source is not None and rules and rules.layers:
        raise UsageError(
            "--init_from with [[layers]] ranges is not supported yet; start from scratch or drop [[layers]]"
        )
    check_auto_remat(cfg)
    if output:  # a training job on the devices JAX has (explain may compile for a TPU topology instead)
        check_kernel(model, policy, cfg.seq_len)
        check_output(cfg, model)
    if policy.remat == "auto":
        policy = policy.replace(remat=auto_remat(cfg, model, policy, shape))
    if output:
        check_memory(cfg, model, policy, shape)
    job = Job(model, policy, shape, dcn if jax.process_count() > 1 else None, pipeline, strategy, rules, init_source)
    return _build(job) if build else job


def resolve_serving(
    model: ModelConfig,
    *,
    mesh_dim: str,
    dtype: str = "auto",
    max_batch: int | None = None,
    max_seq_len: int | None = None,
    build: bool = True,
) -> Job:
    """A serving job for a model read from its weights: --mesh_dim over the devices JAX has (hosts
    over dp first), compute and weight dtype `dtype`, no remat. Checks the decode batch (default
    dp×fsdp), the context (default the model's, at most 2048) and the model's dimensions against the
    mesh before any weights are read."""
    import jax

    from meshlm.platform import resolve_dtype
    from meshlm.strategy import DEFAULT

    check_dtype(dtype)
    shape, dcn = meshlib.resolve_hybrid(mesh_dim, None, False, None, jax.device_count(), jax.process_count())
    if shape.pp > 1:
        raise UsageError(f"--mesh_dim={mesh_dim}: serving runs without pipeline stages; drop pp")
    context = max_seq_len or min(model.max_seq_len, SERVING_CONTEXT)
    check_serving_mesh(shape, model, max_batch, context, mesh_dim)
    compute = resolve_dtype(dtype, serving=True)
    policy = RunPolicy(dtype=compute, param_dtype=compute, remat="none")
    check_serving_memory(model, compute, shape, max_batch or shape.data, context)
    job = Job(model, policy, shape, dcn if jax.process_count() > 1 else None, None, DEFAULT, None)
    return _build(job) if build else job


def check_serving_memory(
    model: ModelConfig, dtype: str, shape: MeshShape, max_batch: int, context: int, device=None
) -> None:
    """`check_memory` for serving: the weights and the KV cache in `dtype` against what a device may use."""
    from meshlm.plan.fit import serving_misfit as memory_misfit

    if memory_check_off():
        return
    budget, where = device_memory(device)
    problem = memory_misfit(model, dtype, shape, max_batch, context, budget, where) if budget else None
    if problem:
        raise UsageError(f"{problem} ({MEMORY_CHECK}=0 runs it anyway)")


def serving_misfit(shape: MeshShape, model: ModelConfig, max_batch: int | None, context: int) -> str | None:
    """Why a serving mesh cannot hold this model and its KV cache, or None: train's checks (decode
    slots as the batch, the cache's context as seq_len, heads, MLP and vocabulary over tp, in train's
    words), and the weights' embedding dimension over fsdp×sp, as serving lays them out."""
    problem = meshlib.check_shape_fits(
        shape,
        batch_size=max_batch or shape.data,
        seq_len=context,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        mlp_dim=model.mlp_dim,
        vocab_size=model.vocab_size,
    )
    if problem is None and model.d_model % (shape.fsdp * shape.sp):
        problem = f"d_model = {model.d_model} is not divisible by fsdp×sp = {shape.fsdp * shape.sp}"
    return problem


def check_max_batch(max_batch: int, data: int) -> None:
    """--max_batch against the data-parallel size `data` (dp×fsdp): each data shard serves as many slots."""
    if max_batch <= 0 or max_batch % data:
        raise UsageError(
            f"--max_batch={max_batch} must be a positive multiple of dp×fsdp = {data} "
            f"(try --max_batch={max(data, math.ceil(max(max_batch, 1) / data) * data)})"
        )


def check_serving_mesh(
    shape: MeshShape, model: ModelConfig, max_batch: int | None, context: int, mesh_dim: str | None = None
) -> None:
    """One line, as train's: the problem and meshes of these devices that serve the model, or the
    serving flags to change (serving has no --strategy). `mesh_dim`: the flag as given, named beside the
    resolved mesh when it had a -1 (the default, tp over every device, is one)."""
    if max_batch is not None:
        check_max_batch(max_batch, shape.data)
    problem = serving_misfit(shape, model, max_batch, context)
    if problem is None:
        return
    working = [
        s for s in meshlib.all_mesh_shapes(shape.n_devices) if serving_misfit(s, model, max_batch, context) is None
    ]
    working.sort(key=lambda s: (-s.fsdp, -s.tp, s.sp, s.dp))  # as train lists them
    hint = (
        f"meshes that work on these {shape.n_devices} devices: " + ", ".join(f"--mesh_dim={s}" for s in working[:4])
        if working
        else f"no mesh of these {shape.n_devices} devices fits; change --devices, --max_batch or --max_seq_len"
    )
    given = f"--mesh_dim={mesh_dim} (that is {shape})" if mesh_dim and "-1" in mesh_dim else f"--mesh_dim={shape}"
    raise UsageError(f"{given}: {problem}; {hint}")


def _build(job: Job) -> Job:
    from meshlm.models.placement import place

    job.mesh = meshlib.build_mesh(job.shape, dcn=job.dcn)
    job.placement = place(job.model, job.mesh, job.strategy, job.rules, policy=job.policy)
    return job
