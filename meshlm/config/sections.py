"""The sections of a run's settings: mesh, cluster, model, pipeline, batch, precision, optimizer, lora,
data, finetune data, eval, checkpoint, logging and tracking.

Each section is a dataclass whose fields are the command-line flags (a field's `help` metadata is
its help text, `cli=False` keeps it off the command line) and whose `check(run)` finds bad values
before anything else runs (`run`: the whole `meshlm.config.TrainConfig`, for checks across sections).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.errors import UsageError
from meshlm.models.lora_options import DEFAULT_TARGETS as LORA_TARGETS
from meshlm.models.lora_options import check_lora
from meshlm.models.remat import POLICIES as REMAT_POLICIES
from meshlm.ops.kernel_names import KERNELS as ATTENTION

# Compute dtypes a flag may name; `auto` is bfloat16 where matmuls are fast in it, else float32 (meshlm.platform).
DTYPES = ("auto", "float32", "bfloat16", "float16")
PARAM_DTYPES = ("float32", "bfloat16")
# Metric trackers (meshlm.train.tracking opens them; it sits above this module, so the names live here).
TRACKERS = ("tensorboard", "wandb", "none")
# Rematerialisation policies (meshlm.models.remat), or `auto`: the planner's choice (meshlm.job.auto_remat).
REMAT = ("auto", *REMAT_POLICIES)


def _flag(default, help: str, **kw):
    if default is dict:
        return field(default_factory=dict, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def check_dtype(value: str, flag: str = "--dtype") -> None:
    if value not in DTYPES:
        raise UsageError(f"{flag}={value}: choose {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")


def check_positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name}={value} must be a positive integer")


@dataclass
class MeshConfig:
    """Which mesh and which layout of the model on it."""

    mesh_dim: str | None = _flag(
        None, "dp,fsdp,tp,sp sizes, e.g. 1,8,1,1 or fsdp:-1,tp:2; one may be -1 (default: all fsdp)"
    )
    mp_mesh_dim: str | None = _flag(None, "EasyLM form: model-parallel sizes tp,sp only; data parallelism is inferred")
    fsdp: bool = _flag(False, "with --mp_mesh_dim: shard parameters over the data axis too (fsdp instead of dp)")
    strategy: str = _flag(
        "default",
        "sharding preset: default, dp, fsdp, fsdp_tp, megatron, megatron_sp, fsdp_sp (tables in docs/strategies.md)",
    )
    zero_stage: int | None = _flag(
        None,
        "ZeRO over the axes the batch splits over: 0 replicate all, 1 shard optimizer state, 2 and gradients (reduce-scatter), 3 and parameters (default: as the preset says)",
    )
    sharding_rules: str | None = _flag(
        None,
        "TOML file of overrides over the preset: [logical] axes, [[rules]] regex on parameter paths -> spec, [[layers]] ranges -> preset",
    )
    devices: int | None = _flag(None, "simulate N CPU devices (sets XLA's host device count; CPU only; per process)")
    dcn_mesh_dim: str | None = _flag(
        None,
        "several hosts: how many ways each of dp,fsdp,tp,sp is split across hosts; --mesh_dim is then one host's share (default: --mesh_dim is the whole mesh, hosts over dp, then fsdp)",
    )

    def check(self, run=None) -> None:
        check_positive(self, "devices")


@dataclass
class ClusterConfig:
    """Several processes (hosts): how this one joins the others (meshlm.distributed)."""

    coordinator_address: str | None = _flag(
        None,
        "several processes: HOST:PORT of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS, or the cluster's own, e.g. SLURM)",
    )
    num_processes: int | None = _flag(None, "several processes: how many (default: $JAX_NUM_PROCESSES, or 1)")
    process_id: int | None = _flag(
        None, "several processes: this one's rank, 0 .. num_processes-1 (default: $JAX_PROCESS_ID)"
    )
    peer_timeout: float = _flag(20.0, "several processes: stop when another process is silent for this many seconds")
    connect_timeout: float = _flag(
        120.0, "several processes: how long to wait for the coordinator at start-up, in seconds"
    )

    def check(self, run=None) -> None:
        pass  # meshlm.distributed.resolve checks these together with the environment


@dataclass
class ModelSection:
    """Which model: a preset or a config.json, field overrides, and starting weights."""

    model: str | None = _flag(
        None,
        "preset name or path of a Hugging Face config.json (default: tiny, or the --init_from model); fields via --model.FIELD=VALUE",
    )
    init_from: str | None = _flag(
        None, "start from these weights: hf:DIR (a Hugging Face LLaMA folder) or a meshlm convert/export folder"
    )
    model_overrides: dict = _flag(dict, "set by --model.FIELD=VALUE", cli=False)

    def check(self, run=None) -> None:
        pass  # meshlm.job.resolve_model reads and checks the model


@dataclass
class PipelineConfig:
    """Pipeline stages over the pp mesh axis."""

    pp: int = _flag(
        1,
        "pipeline stages: the layers split over pp groups of devices (also pp:N in --mesh_dim); devices = pp × dp × fsdp × tp × sp",
    )
    pipeline_schedule: str = _flag(
        "1f1b", "with --pp: gpipe, 1f1b (memory bounded by 2·pp microbatches) or interleaved (with --virtual_stages)"
    )
    microbatches: int | None = _flag(
        None, "with --pp: microbatches per step (default: 2·pp); the batch splits into them"
    )
    virtual_stages: int = _flag(
        1, "with --pipeline_schedule=interleaved: stages per device (the bubble shrinks by this much)"
    )

    def check(self, run=None) -> None:
        pass  # meshlm.job.pipeline_schedule checks them against the mesh and the model


@dataclass
class BatchConfig:
    """What one optimizer step sees."""

    batch_size: int = _flag(8, "global batch size in sequences (all devices, all micro-batches)")
    seq_len: int = _flag(256, "tokens per sequence")
    grad_accum: int = _flag(1, "micro-batches per step (gradient accumulation)")

    def check(self, run=None) -> None:
        check_positive(self, "batch_size", "seq_len", "grad_accum")
        if self.batch_size % self.grad_accum:
            raise UsageError(f"--batch_size={self.batch_size} is not divisible by --grad_accum={self.grad_accum}")


@dataclass
class PrecisionConfig:
    """Number formats and rematerialisation."""

    dtype: str = _flag(
        "auto",
        "compute dtype: auto (bfloat16 on GPU/TPU and on CPUs with bf16 matmul instructions, float32 on other CPUs), float32, bfloat16",
    )
    param_dtype: str = _flag(
        "float32",
        "parameter and optimizer-state dtype: float32 (bfloat16 is refused for training: it would keep no float32 master copy; use --dtype=bfloat16 for bf16 compute)",
    )
    remat: str = _flag(
        "auto",
        "rematerialisation policy, what each layer keeps for the backward: auto (the least "
        "recomputation whose predicted peak fits the device; on CPU none while a step's scratch stays under 64 MiB a device, else save_qkv_attn; in meshlm plan the fastest "
        "that fits, with more --grad_accum if needed), none (everything), "
        "save_dots (matmul outputs), save_attn (q, k, v, attention output and its projection: recompute "
        "the MLP), save_qkv_attn (q, k, v, attention output), full (the layer input)",
    )
    attention: str = _flag(
        "auto",
        "attention kernel: auto (splash on TPU, cuDNN or Triton on GPU, on CPU dense below 256 tokens, blockwise from 256), blockwise, dense, cudnn, triton, splash",
    )

    def check(self, run=None) -> None:
        check_dtype(self.dtype)
        # Training in these formats goes wrong without an error: refused until they get what they need.
        if self.dtype == "float16":
            raise UsageError(
                "--dtype=float16 trains without loss scaling (small gradients underflow to zero); "
                "train with --dtype=bfloat16 (float16 stays available to meshlm generate and serve)"
            )
        if self.param_dtype == "bfloat16":
            raise UsageError(
                "--param_dtype=bfloat16 keeps no float32 master copy (small updates round away); use "
                "--dtype=bfloat16 --param_dtype=float32: float32 master weights, bfloat16 compute"
            )
        if self.param_dtype not in PARAM_DTYPES:
            raise UsageError(f"--param_dtype={self.param_dtype}: choose float32 (the compute dtype is --dtype)")
        if self.remat not in REMAT:
            raise UsageError(f"--remat={self.remat!r}: choose one of {', '.join(REMAT)}")
        if self.attention not in ATTENTION:
            raise UsageError(f"--attention={self.attention!r}: choose one of {', '.join(ATTENTION)}")


@dataclass
class OptimizerSection:
    """AdamW and its learning-rate schedule over --steps."""

    steps: int = _flag(200, "optimizer steps to take (steps count from 1)")
    lr: float = _flag(3e-4, "peak learning rate")
    warmup_steps: int | None = _flag(None, "linear warm-up steps (default: 10%% of the schedule's steps, at most 1000)")
    min_lr_ratio: float = _flag(0.1, "cosine decay ends at lr × this")
    weight_decay: float = _flag(0.1, "AdamW weight decay (never applied to norm scales)")
    clip_norm: float = _flag(1.0, "global gradient-norm clip; 0 disables")
    schedule_steps: int | None = _flag(
        None,
        "steps the warm-up and cosine decay are laid over (default: --steps); "
        "when resuming with a larger --steps, pass the first run's --steps to keep its "
        "learning-rate schedule (after it the rate stays at lr × --min_lr_ratio)",
    )

    def check(self, run=None) -> None:
        check_positive(self, "steps", "schedule_steps")


@dataclass
class LoraConfig:
    """LoRA fine-tuning: low-rank adapters on frozen base weights (docs/lora.md)."""

    lora_rank: int = _flag(
        0,
        "LoRA adapter rank r (0: off, train every weight); the base weights freeze and only "
        "the adapters A [in, r], B [r, out] train",
    )
    lora_alpha: float = _flag(16.0, "LoRA scale numerator: the model runs W + (alpha / r)·A·B")
    lora_targets: str = _flag(
        LORA_TARGETS,
        "regex searched in parameter paths (layers/attn/wq, layers/mlp/down, "
        "lm_head ...) naming the weights that get adapters (default: the attention and MLP projections)",
    )
    lora_base_dtype: str = _flag("float32", "dtype the frozen base weights are held in with LoRA: float32 or bfloat16")

    def check(self, run=None) -> None:
        check_lora(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_base_dtype)
        if self.lora_rank and run is not None and run.pp > 1:
            raise UsageError("--lora_rank with --pp: LoRA does not run pipelined yet; drop --pp")


@dataclass
class DataConfig:
    """Where the tokens come from."""

    dataset: str = _flag(
        "stdlib",
        "stdlib (Python's own sources), synthetic, a .txt/.jsonl/.json (optionally .gz or .zst) or .parquet file, "
        "folder or glob, hf:NAME[:split] (streamed), or a mixture file mix.toml/.yaml (docs/data.md)",
    )
    tokenizer: str | None = _flag(
        None, "tokenizer.json or a folder holding one (default: BPE trained on the dataset and cached)"
    )
    seed: int = _flag(0, "seed for parameters and data order")

    def check(self, run=None) -> None:
        pass


@dataclass
class ChatDataConfig:
    """Fine-tuning data: chat conversations (JSONL lines with a "messages" list, found by that list) and
    plain JSONL text under another key (docs/finetune.md)."""

    text_field: str = _flag(
        "text", "the JSON key (or Parquet / Hugging Face dataset column) that holds a plain-text document"
    )
    chat_template: str | None = _flag(
        None,
        "chat data: render conversations with this template: plain, chatml (Qwen), gemma, mistral, "
        "or a Jinja file (default: the tokenizer's own, else plain); serving renders alike",
    )
    loss_on: str | None = _flag(
        None, "chat data: which targets count in the loss: assistant (the replies, default for chat data) or all"
    )
    long_conversations: str | None = _flag(
        None,
        "chat data: a conversation longer than --seq_len is cut to it "
        "(truncate, the default) or left out (drop); the log counts them",
    )

    def check(self, run=None) -> None:
        from meshlm.data.chat import LONG_CONVERSATIONS, LOSS_ON

        if not self.text_field.strip():
            raise UsageError("--text_field is empty; name the JSONL key that holds the text, e.g. --text_field=content")
        if self.loss_on is not None and self.loss_on not in LOSS_ON:
            raise UsageError(f"--loss_on={self.loss_on}: choose {' or '.join(LOSS_ON)}")
        if self.long_conversations is not None and self.long_conversations not in LONG_CONVERSATIONS:
            raise UsageError(
                f"--long_conversations={self.long_conversations}: choose {' or '.join(LONG_CONVERSATIONS)}"
            )
        if self.chat_template is not None and not self.chat_template.strip():
            raise UsageError(
                "--chat_template is empty; name plain, chatml, gemma, mistral or a Jinja file, or leave it out"
            )


@dataclass
class EvalConfig:
    """Evaluation during training: loss and perplexity on rows that never train (off unless a source is given)."""

    eval_dataset: str | None = _flag(
        None, "evaluate on this dataset (any --dataset spec), tokenized like the training data"
    )
    eval_split: float | None = _flag(
        None,
        "evaluate on this fraction of the training rows, e.g. 0.01, held out of "
        "training (the same rows whatever the seed)",
    )
    eval_every: int | None = _flag(None, "evaluate every N steps and after the last one (default: --steps / 10)")
    eval_batches: int | None = _flag(
        None,
        "batches of --batch_size rows per evaluation, the same rows each time "
        "(default: as many as the held-out rows give, at most 10)",
    )

    def check(self, run=None) -> None:
        if self.eval_dataset is not None and self.eval_split is not None:
            raise UsageError("--eval_dataset and --eval_split both choose the evaluation rows; pass one of them")
        if self.eval_split is not None and not 0.0 < self.eval_split < 1.0:
            raise UsageError(f"--eval_split={self.eval_split} must be a fraction strictly between 0 and 1, e.g. 0.01")
        if self.eval_dataset is not None and not self.eval_dataset.strip():
            raise UsageError("--eval_dataset is empty; name a dataset as for --dataset, or leave it out")
        for name in ("eval_every", "eval_batches"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name}={value} must be a positive integer")
            if value is not None and not self.evaluates:
                raise UsageError(f"--{name} needs something to evaluate: add --eval_split=0.01 or --eval_dataset=...")

    @property
    def evaluates(self) -> bool:
        return self.eval_dataset is not None or self.eval_split is not None


@dataclass
class CheckpointConfig:
    """Where the run's files go and how often it saves."""

    output_dir: str = _flag(
        "outputs/train",
        "the run's folder: checkpoints/ (a re-run resumes from the newest), "
        "metrics.jsonl, TensorBoard events (tb/), loss.png, config.json and the tokenizer",
    )
    save_every: int = _flag(
        0, "save a checkpoint every N steps (0: only at the end); re-running resumes from the newest"
    )
    keep: int = _flag(3, "how many of the newest checkpoints to keep")

    def check(self, run=None) -> None:
        if self.save_every < 0 or self.keep <= 0:
            raise UsageError("--save_every must be ≥ 0 and --keep ≥ 1")


@dataclass
class LoggingConfig:
    """What the console, metrics.jsonl and TensorBoard get."""

    log_every: int = _flag(10, "log loss, tokens/s, TFLOP/s per device and MFU every N steps")
    peak_tflops: float | None = _flag(
        None, "peak TFLOP/s per device for MFU (default: built-in table, or a matmul probe on CPU)"
    )

    def check(self, run=None) -> None:
        check_positive(self, "log_every")


@dataclass
class TrackingConfig:
    """Where the metrics go besides metrics.jsonl, and diagnostics (a run stops at a NaN/Inf loss or gradient)."""

    tracker: str = _flag(
        "tensorboard",
        "also send the metrics to: tensorboard (tb/ in the run folder), wandb "
        "(pip install wandb; WANDB_MODE=offline works without a network) or none",
    )
    profile_steps: str | None = _flag(
        None,
        "A:B: write a jax.profiler trace of steps A to B into the run folder's "
        "profile/ (open it in TensorBoard's profile tab or Perfetto)",
    )

    def check(self, run=None) -> None:
        if self.tracker not in TRACKERS:
            raise UsageError(f"--tracker={self.tracker}: choose {', '.join(TRACKERS[:-1])} or {TRACKERS[-1]}")
        if self.tracker == "wandb":
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise UsageError(
                    "--tracker=wandb needs the wandb package: pip install wandb (or --tracker=tensorboard)"
                )
        if self.profile_steps is not None:
            first, last = profile_range(self.profile_steps)
            steps = run.steps if run is not None else None
            if steps is not None and first > steps:
                raise UsageError(
                    f"--profile_steps={self.profile_steps} starts after the last step ({steps}); "
                    f"pick steps within --steps"
                )


def profile_range(spec: str) -> tuple[int, int]:
    """`--profile_steps=A:B` as (A, B), steps counted from 1 and A <= B."""
    first, sep, last = spec.partition(":")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        a = b = 0
    if not (sep or not last) or a < 1 or b < a:
        raise UsageError(
            f"--profile_steps={spec}: write FIRST:LAST, two step numbers from 1 with FIRST <= LAST, e.g. 5:8"
        )
    return a, b


# The sections in the order their flags are listed by `meshlm train --help`: help-group title -> class.
SECTIONS = {
    "mesh": MeshConfig,
    "cluster": ClusterConfig,
    "model": ModelSection,
    "pipeline": PipelineConfig,
    "batch": BatchConfig,
    "precision": PrecisionConfig,
    "optimizer": OptimizerSection,
    "lora": LoraConfig,
    "data": DataConfig,
    "finetune data": ChatDataConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "tracking": TrackingConfig,
}
