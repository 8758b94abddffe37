"""Model shapes: the `ModelConfig` dataclass and its `--model.FIELD=VALUE` overrides.

Named presets and `resolve_model` (`--model=tiny` or a config.json) are `meshlm.models.presets`; the
Hugging Face config.json mapping is `meshlm.models.hf_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshlm.errors import UsageError

ROPE_SCALINGS = ("llama3", "linear", "yarn")  # the RoPE scalings `meshlm.models.rope` implements
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's activation: SwiGLU, or GeGLU with tanh-approximated gelu
# The Hugging Face model_types meshlm runs (`meshlm.models.hf_config` maps each config.json and exports it).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling as Hugging Face configs spell it (`rope_type` and its parameters).

    llama3: long wavelengths slowed by `factor`, short kept, a smooth blend between (low/high_freq_factor).
    linear: every frequency divided by `factor` (position interpolation).
    yarn: per-frequency blend of interpolation and extrapolation between `beta_slow` and `beta_fast`
    rotations, and cos/sin scaled by `attention_factor` (0: 0.1 ln(factor) + 1)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise UsageError(
                f"rope_scaling type {self.kind!r} is not implemented; use one of {', '.join(ROPE_SCALINGS)}"
            )
        if self.factor <= 0:
            raise UsageError(f"rope_scaling factor={self.factor} must be positive")


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder is (`meshlm.models.decoder`): its shapes and the fields the families differ by;
    how a run runs it (dtypes, remat, kernels) is `meshlm.models.policy.RunPolicy`. Every field can be
    overridden from the CLI as --model.FIELD. The architecture fields after `tie_embeddings` turn on what
    the open families differ by; each is named for what it does, and its default is LLaMA's."""

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
    # -- what the families differ by
    family: str = "llama"  # the Hugging Face model_type written on export (weights' names, chat format)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    out_bias: bool = False  # a bias on the attention output projection
    mlp_bias: bool = False  # biases on the MLP's three projections
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before each residual add (Gemma 2, 3)
    norm_offset: float = 0.0  # norms scale by (norm_offset + weight): Gemma's 1 + w
    embed_scale: bool = False  # embeddings multiplied by sqrt(d_model) (Gemma)
    mlp_activation: str = "silu"  # see ACTIVATIONS
    attention_scale: float = 0.0  # the score scale; 0: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar**-0.5)
    attn_logit_softcap: float = 0.0  # scores -> c·tanh(scores / c) before softmax; 0: none (Gemma 2)
    final_logit_softcap: float = 0.0  # logits -> c·tanh(logits / c); 0: none (Gemma 2)
    sliding_window: int = 0  # local layers attend the last `sliding_window` positions (theirs included)
    # Which layers are local ('L') and which global ('G'), repeated over the layers: "LG" alternates from
    # a local first layer (Gemma 2), "LLLLLG" is Gemma 3's. "": every layer local when sliding_window > 0.
    layer_pattern: str = ""
    local_rope_theta: float = 0.0  # > 0: local layers' RoPE base, without rope_scaling (Gemma 3); 0: as global

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
        if self.n_heads % self.n_kv_heads:
            raise UsageError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: "
                "grouped-query attention needs n_heads divisible by n_kv_heads"
            )
        self._check_variants()

    def _check_variants(self) -> None:
        """The fields that select a family's variants, each refused in one line naming the fix."""
        if self.family not in FAMILIES:
            raise UsageError(f"--model.family={self.family!r}: choose one of {', '.join(FAMILIES)}")
        if self.mlp_activation not in ACTIVATIONS:
            raise UsageError(f"--model.mlp_activation={self.mlp_activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        if bad := set(self.layer_pattern) - {"L", "G"}:
            raise UsageError(
                f"--model.layer_pattern={self.layer_pattern!r} has {''.join(sorted(bad))!r}: write 'L' for a local "
                "layer and 'G' for a global one, e.g. LG (alternating) or LLLLLG"
            )
        if "L" in self.layer_pattern and self.sliding_window <= 0:
            raise UsageError(
                f"--model.layer_pattern={self.layer_pattern!r} has local layers but --model.sliding_window="
                f"{self.sliding_window}: give the window in positions"
            )
        for name in (
            "sliding_window",
            "attention_scale",
            "attn_logit_softcap",
            "final_logit_softcap",
            "local_rope_theta",
        ):
            if getattr(self, name) < 0:
                raise UsageError(f"--model.{name}={getattr(self, name)} must be >= 0 (0: off)")

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: True where it attends a sliding window of `sliding_window` positions."""
        if self.sliding_window <= 0:
            return (False,) * self.n_layers
        pattern = self.layer_pattern or "L"
        return tuple(pattern[i % len(pattern)] == "L" for i in range(self.n_layers))

    def cache_lengths(self, context: int) -> tuple[int, ...]:
        """Per layer, the KV cache slots decoding `context` positions needs: a local layer keeps only its
        window (a ring of `sliding_window` slots), a global layer every position."""
        return tuple(min(context, self.sliding_window) if local else context for local in self.local_layers)

    @property
    def pattern_period(self) -> int:
        """The length of the repeating local/global unit (1 when every layer is alike)."""
        kinds = self.local_layers
        return 1 if len(set(kinds)) <= 1 else len(self.layer_pattern)

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of `meshlm.models.decoder.Decoder` built from this config."""
        e, h, k, d, m, v = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.mlp_dim, self.vocab_size
        per_layer = e * h * d + 2 * e * k * d + h * d * e + 3 * e * m + 2 * e
        per_layer += (h * d + 2 * k * d) * self.qkv_bias + e * self.out_bias + (2 * m + e) * self.mlp_bias
        per_layer += 2 * d * self.qk_norm + 2 * e * self.post_norms
        total = self.n_layers * per_layer + e  # final norm
        if include_embedding:
            total += v * e
        if not self.tie_embeddings or not include_embedding:
            total += e * v  # output head (the tied head is the embedding table)
        return total


def _coerce(name: str, raw: Any, current: Any) -> Any:
    """Turn a CLI string into the type of the field it overrides."""
    if not isinstance(raw, str):
        return raw
    if name == "rope_scaling":
        if raw.lower() in ("none", "null", ""):
            return None
        if raw.lower() == "llama3":
            return RopeScaling()
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
    "apply_overrides",
    "describe",
    "count_params",
]
