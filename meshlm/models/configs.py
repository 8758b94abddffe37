"""Model shapes: the `ModelConfig` dataclass, named presets and Hugging Face `config.json` mapping.

`resolve_model("tiny", {"n_layers": "6"})` is what `--model=tiny --model.n_layers=6` becomes;
`resolve_model("path/to/config.json")` reads a Hugging Face LLaMA config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlm.errors import UsageError, closest


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (`rope_type: llama3` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a LLaMA-family decoder. Every field can be overridden from the CLI."""

    vocab_size: int = 32000
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 0  # 0: d_model // n_heads
    mlp_dim: int = 11008
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"  # compute dtype of matmuls; softmax and loss are always float32
    param_dtype: str = "float32"
    remat: str = "none"  # see meshlm.models.llama.REMAT_POLICIES
    attention: str = "auto"  # attention kernel, see meshlm.ops.kernels
    # Training loss: positions of each row whose float32 logits exist at once (meshlm.models.loss);
    # 0: the whole sequence in one piece.
    loss_chunk: int = 1024
    # Layers per iteration of the training layer loop (a lax.scan): 1 keeps one compiled layer;
    # n_layers unrolls the loop into straight-line code (longer compiles, no per-layer loop overhead);
    # 0: auto, n_layers on GPU (8 llama3-8b layers on an H200: 9% faster, 13 GiB less), 1 elsewhere.
    scan_unroll: int = 0
    # cuDNN attention over packed documents (GPU): the most documents one row holds. Its workspace grows
    # with it ([rows x max_documents, T, heads, head_dim] float32); in a row with more, the documents
    # from the max_documents-th on attend to each other (`meshlm train` warns when a batch has one).
    max_documents: int = 8

    def __post_init__(self):
        if self.head_dim == 0:
            if self.n_heads <= 0 or self.d_model % self.n_heads:
                raise UsageError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                    "set --model.head_dim explicitly or change one of them"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise UsageError(f"--model.{name}={getattr(self, name)} must be a positive integer")
        if self.loss_chunk < 0:
            raise UsageError(f"--model.loss_chunk={self.loss_chunk}: give positions per loss chunk, or 0 for none")
        if self.scan_unroll < 0:
            raise UsageError(f"--model.scan_unroll={self.scan_unroll}: give layers per loop iteration, or 0 for auto")
        if self.max_documents < 1:
            raise UsageError(f"--model.max_documents={self.max_documents} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise UsageError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: "
                "grouped-query attention needs n_heads divisible by n_kv_heads"
            )

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of `meshlm.models.llama.Llama` built from this config."""
        e, h, k, d, m, v = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.mlp_dim, self.vocab_size
        per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * m + 2 * e
        total = self.n_layers * per_layer + e  # final norm
        if include_embedding:
            total += v * e
        if not self.tie_embeddings or not include_embedding:
            total += e * v  # output head (the tied head is the embedding table)
        return total


_LLAMA3_SCALING = RopeScaling(8.0, 1.0, 4.0, 8192)

PRESETS: dict[str, ModelConfig] = {
    # For unit tests: divisible by 8 everywhere so every 8-device mesh is valid.
    "test": ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, mlp_dim=128, max_seq_len=512),
    # The benchmark shape, and what `make run` trains.
    "tiny": ModelConfig(
        vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, mlp_dim=768, max_seq_len=2048
    ),
    "small": ModelConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, mlp_dim=2048),
    # ~1.1B, the shape used for single-accelerator throughput figures.
    "1b": ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp_dim=5632, max_seq_len=2048
    ),
    "llama2-7b": ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_dim=11008),
    "llama2-13b": ModelConfig(vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, n_kv_heads=40, mlp_dim=13824),
    "llama2-70b": ModelConfig(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, mlp_dim=28672),
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        mlp_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": ModelConfig(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        mlp_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        mlp_dim=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
        tie_embeddings=True,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
    ),
}


def _coerce(name: str, raw: Any, current: Any) -> Any:
    """Turn a CLI string into the type of the field it overrides."""
    if not isinstance(raw, str):
        return raw
    if name == "rope_scaling":
        if raw.lower() in ("none", "null", ""):
            return None
        if raw.lower() == "llama3":
            return _LLAMA3_SCALING
        raise UsageError(f"--model.rope_scaling={raw!r}: use 'llama3' or 'none' (or a config.json for custom factors)")
    try:
        if isinstance(current, bool):
            if raw.lower() in ("1", "true", "yes"):
                return True
            if raw.lower() in ("0", "false", "no"):
                return False
            raise ValueError
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        raise UsageError(f"--model.{name}={raw!r} is not a valid {type(current).__name__}") from None
    return raw


def read_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` file: read, validated and mapped by `from_hf_config`.

    Every path that takes a config.json (`--model=`, `--init_from=hf:`, convert, serve) reads it here, so a
    config meshlm cannot run gets the same one-line error everywhere."""
    path = Path(path)
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{path} is not a config.json (a JSON object of LlamaConfig fields)")
    return from_hf_config(hf, str(path))


def from_hf_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Map a Hugging Face LlamaConfig dict onto a ModelConfig; a variant meshlm's LLaMA cannot run is named
    (`where`, the file it came from, starts the message)."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UsageError(f"{where}: attention_bias/mlp_bias models are not supported (meshlm's LLaMA has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; LLaMA uses 'silu'")
    rope = hf.get("rope_parameters")  # transformers >= 5 nests theta and scaling here
    if isinstance(rope, dict):
        hf = dict(hf)
        hf.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", rope.get("type", "default")) != "default" and not hf.get("rope_scaling"):
            hf["rope_scaling"] = rope
    if {"model", "train", "mesh_dim"} <= set(hf):  # the config.json `meshlm train` writes in its run folder
        folder = Path(where).parent if Path(where).name == "config.json" else Path(where)
        raise UsageError(
            f"{where} is a meshlm run's settings, not a model config; start from its weights with "
            f"--init_from={folder}, or continue the run with --output_dir={folder}"
        )
    arch = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in arch:
        raise UsageError(
            f"{where} describes model_type={hf.get('model_type')!r}; only LLaMA-family models are supported"
        )
    try:
        n_heads = hf["num_attention_heads"]
        scaling = None
        rs = hf.get("rope_scaling")
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind != "llama3":
                raise UsageError(f"{where}: rope_scaling type {kind!r} is not supported; only 'llama3' is")
            scaling = RopeScaling(
                float(rs["factor"]),
                float(rs.get("low_freq_factor", 1.0)),
                float(rs.get("high_freq_factor", 4.0)),
                int(rs.get("original_max_position_embeddings", 8192)),
            )
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            mlp_dim=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 4096),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except KeyError as e:
        close = closest(e.args[0], [k for k in hf if isinstance(k, str)], cutoff=0.8)
        hint = f" (it has {close!r}: a misspelling?)" if close else ""
        raise UsageError(f"{where} lacks the field {e.args[0]!r} that a LlamaConfig has{hint}") from None


def to_hf_config(cfg: ModelConfig, weights_dtype: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for this model (LlamaForCausalLM); `weights_dtype` names the
    dtype of the weights written beside it (default float32)."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    if weights_dtype is not None:
        out["torch_dtype"] = out["dtype"] = weights_dtype
    return out


def resolve_model(name_or_path: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A preset name or a Hugging Face `config.json` path (or its directory), then field overrides."""
    overrides = dict(overrides or {})
    path = Path(name_or_path)
    if name_or_path in PRESETS:
        base = PRESETS[name_or_path]
    elif path.suffix == ".json" or path.is_dir():
        cfg_path = path / "config.json" if path.is_dir() else path
        if not cfg_path.is_file():
            raise UsageError(f"--model={name_or_path}: no such file {cfg_path}")
        base = read_hf_config(cfg_path)
    else:
        raise UsageError(f"--model={name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json path")
    return apply_overrides(base, overrides)


def apply_overrides(base: ModelConfig, overrides: dict[str, Any]) -> ModelConfig:
    """`--model.FIELD=VALUE` overrides, each coerced to the field's type."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    changes = {}
    for key, raw in overrides.items():
        if key not in fields:
            raise UsageError(f"--model.{key}: unknown model field; known fields: {', '.join(fields)}")
        changes[key] = _coerce(key, raw, getattr(base, key))
    if "d_model" in changes or "n_heads" in changes:
        changes.setdefault("head_dim", 0 if "head_dim" not in overrides else changes["head_dim"])
    return dataclasses.replace(base, **changes)


def count_params(n: float) -> str:
    """A parameter count as people read it: 5.51M, 1.24B, 820K, 640."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def describe(cfg: ModelConfig) -> str:
    return (
        f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv) x {cfg.head_dim}, "
        f"mlp {cfg.mlp_dim}, vocab {cfg.vocab_size}: {count_params(cfg.num_params())} parameters"
    )


__all__ = [
    "ModelConfig",
    "RopeScaling",
    "PRESETS",
    "resolve_model",
    "apply_overrides",
    "from_hf_config",
    "read_hf_config",
    "to_hf_config",
    "describe",
    "count_params",
]
