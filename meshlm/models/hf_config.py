"""Hugging Face `config.json` <-> `ModelConfig`: every family meshlm runs, read and written.

Every path that takes a config.json (`--model=`, `--init_from=hf:`, convert, serve) reads it with
`read_hf_config`, so a config meshlm cannot run gets the same one-line error everywhere. A field the file
leaves out takes the default of the family's transformers config class (`FAMILY`). `to_hf_config` writes
the family's own config.json and refuses a model the family cannot express. RoPE is `hf_rope`; the
weights' names are `meshlm.checkpoint.hf_map`; docs/checkpoints.md has the table of families.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlm.errors import UsageError, closest
from meshlm.models.configs import FAMILIES, ModelConfig
from meshlm.models.hf_rope import read_rope, write_rope


@dataclass(frozen=True)
class Family:
    """What a transformers config class implies: its architecture, defaults and fixed variants."""

    arch: str
    head_dim: int = 0  # default head_dim (0: hidden_size // num_attention_heads)
    tie: bool = False  # default tie_word_embeddings
    act_key: str = "hidden_act"
    act: str = "silu"
    max_pos: int = 2048
    biases: str = "attention_bias"  # "attention_bias": q, k, v, o biases by that field; "qkv": always; "": none
    mlp_bias: bool = False  # reads mlp_bias
    window: str = ""  # "all": every layer local (Mistral); "qwen", "alternate", "pattern": layer_types
    gemma: int = 0  # 1: (1 + w) norms and sqrt(d_model) embeddings; 2: post-norms, scale and soft-caps too
    qk_norm: bool = False
    softcaps: tuple[float, float] = (0.0, 0.0)  # default attn_logit_softcapping, final_logit_softcapping


GEMMA_2_3 = Family("", 256, True, "hidden_activation", "gelu_pytorch_tanh", gemma=2)
FAMILY = {
    "llama": Family("LlamaForCausalLM", mlp_bias=True),
    "mistral": Family("MistralForCausalLM", max_pos=131072, biases="", window="all"),
    "qwen2": Family("Qwen2ForCausalLM", max_pos=32768, biases="qkv", window="qwen"),
    "qwen3": Family("Qwen3ForCausalLM", head_dim=128, max_pos=32768, window="qwen", qk_norm=True),
    "gemma": Family("GemmaForCausalLM", 256, True, act="gelu_pytorch_tanh", max_pos=8192, gemma=1),
    "gemma2": dataclasses.replace(
        GEMMA_2_3, arch="Gemma2ForCausalLM", max_pos=8192, window="alternate", softcaps=(50.0, 30.0)
    ),
    "gemma3_text": dataclasses.replace(
        GEMMA_2_3, arch="Gemma3ForCausalLM", max_pos=131072, window="pattern", qk_norm=True
    ),
}
assert set(FAMILY) == set(FAMILIES)
ARCH_FAMILY = {f.arch: name for name, f in FAMILY.items()}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Gemma 3's text model as Gemma3ForConditionalGeneration's text_config holds it: fields it may leave out.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4,
)  # fmt: skip


def read_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` file: read, validated and mapped by `from_hf_config`."""
    path = Path(path)
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{path} is not a config.json (a JSON object of a transformers config's fields)")
    return from_hf_config(hf, str(path))


def _family_of(hf: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """The family a config.json describes, and the dict of its text model's fields."""
    if {"model", "train", "mesh_dim"} <= set(hf):  # the config.json `meshlm train` writes in its run folder
        folder = Path(where).parent if Path(where).name == "config.json" else Path(where)
        raise UsageError(
            f"{where} is a meshlm run's settings, not a model config; start from its weights with "
            f"--init_from={folder}, or continue the run with --output_dir={folder}"
        )
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    family = hf.get("model_type") or ARCH_FAMILY.get(arch, "llama")
    if family == "gemma3" and isinstance(hf.get("text_config"), dict):  # Gemma3ForConditionalGeneration
        text = GEMMA3_TEXT_DEFAULTS | hf["text_config"]
        return "gemma3_text", text | {"tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    if family not in FAMILY:
        raise UsageError(f"{where}: model_type={family!r} is not a family meshlm runs; it runs {', '.join(FAMILIES)}")
    return family, hf


def _activation(hf: dict[str, Any], fam: Family, family: str, where: str) -> str:
    act = hf.get(fam.act_key) or fam.act
    if family == "gemma" and act == "gelu":  # transformers reads Gemma's legacy "gelu" as the tanh form
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UsageError(f"{where}: {fam.act_key}={act!r} is not supported; meshlm runs {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def _local_layers(hf: dict[str, Any], fam: Family, n_layers: int, where: str) -> tuple[int, list[bool]]:
    """(sliding window, per layer: local?) as transformers builds them for the family."""
    if not fam.window:
        return 0, [False] * n_layers
    window = hf.get("sliding_window", 4096)
    if fam.window == "qwen" and not hf.get("use_sliding_window", False):
        window = None
    if fam.window == "all" or not window:
        return int(window or 0), [bool(window)] * n_layers
    types = hf.get("layer_types")
    if types is None:
        if fam.window == "qwen":
            first = hf.get("max_window_layers", 28)
            return int(window), [i >= first for i in range(n_layers)]
        period = 2 if fam.window == "alternate" else int(hf.get("sliding_window_pattern", 6))
        return int(window), [bool((i + 1) % period) for i in range(n_layers)]
    if (
        not isinstance(types, list)
        or len(types) != n_layers
        or not set(types) <= {"sliding_attention", "full_attention"}
    ):
        raise UsageError(
            f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for each of the "
            f"{n_layers} layers; got {types!r}"
        )
    return int(window), [t == "sliding_attention" for t in types]


def layer_pattern(local: list[bool]) -> str:
    """The shortest repeating 'L'/'G' unit of the per-layer kinds ("" when every layer is local)."""
    if all(local):
        return ""
    kinds = "".join("L" if x else "G" for x in local)
    period = next(p for p in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
    return kinds[:period]


def _variants(hf: dict[str, Any], fam: Family, family: str, head_dim: int, n_layers: int, where: str) -> dict:
    """The ModelConfig fields that select the family's variants."""
    attention_bias = fam.biases == "attention_bias" and bool(hf.get("attention_bias", False))
    window, local = _local_layers(hf, fam, n_layers, where)
    if hf.get("use_bidirectional_attention"):
        raise UsageError(f"{where}: use_bidirectional_attention=true (an encoder) is not supported; meshlm is causal")
    out: dict[str, Any] = dict(
        family=family,
        qkv_bias=attention_bias or fam.biases == "qkv",
        out_bias=attention_bias,
        mlp_bias=fam.mlp_bias and bool(hf.get("mlp_bias", False)),
        qk_norm=fam.qk_norm,
        post_norms=fam.gemma == 2,
        norm_offset=1.0 if fam.gemma else 0.0,
        embed_scale=bool(fam.gemma),
        mlp_activation=_activation(hf, fam, family, where),
        sliding_window=window if any(local) else 0,
        layer_pattern=layer_pattern(local) if any(local) else "",
    )
    if fam.gemma == 2:
        scalar = hf.get("query_pre_attn_scalar") or 256
        caps = [hf.get(k, d) for k, d in zip(("attn_logit_softcapping", "final_logit_softcapping"), fam.softcaps)]
        out["attention_scale"] = 0.0 if scalar == head_dim else float(scalar) ** -0.5
        out["attn_logit_softcap"], out["final_logit_softcap"] = (float(c or 0.0) for c in caps)
    return out


def from_hf_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Map a Hugging Face config.json dict (any family in FAMILIES) onto a ModelConfig; a model meshlm cannot
    run is named in one line (`where`, the file it came from, starts the message)."""
    family, hf = _family_of(hf, where)
    fam = FAMILY[family]
    try:
        n_heads, n_layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or fam.head_dim or hf["hidden_size"] // n_heads
        max_pos = int(hf.get("max_position_embeddings") or fam.max_pos)
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            mlp_dim=hf["intermediate_size"],
            max_seq_len=max_pos,
            **read_rope(hf, family, max_pos, where),
            norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", fam.tie)),
            init_std=float(hf.get("initializer_range", 0.02)),
            **_variants(hf, fam, family, head_dim, n_layers, where),
        )
    except KeyError as e:
        close = closest(e.args[0], [k for k in hf if isinstance(k, str)], cutoff=0.8)
        hint = f" (it has {close!r}: a misspelling?)" if close else ""
        raise UsageError(f"{where} lacks the field {e.args[0]!r} that a {fam.arch[:-11]}Config has{hint}") from None


def _family_fields(cfg: ModelConfig, fam: Family) -> dict[str, Any]:
    """The fields of cfg's config.json that only some families read."""
    out: dict[str, Any] = {fam.act_key: {v: k for k, v in ACTIVATIONS.items()}[cfg.mlp_activation]}
    if fam.biases == "attention_bias":
        out["attention_bias"] = cfg.qkv_bias
    if fam.mlp_bias:
        out["mlp_bias"] = cfg.mlp_bias
    local = cfg.local_layers
    if fam.window:
        out["sliding_window"] = cfg.sliding_window or None
    if fam.window and fam.window != "all":
        out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
    if fam.window == "qwen":
        out["use_sliding_window"] = any(local)
        out["max_window_layers"] = next((i for i, x in enumerate(local) if x), cfg.n_layers)
    if fam.gemma == 2:
        scale = cfg.attention_scale or cfg.head_dim**-0.5
        scalar = scale**-2.0
        out["query_pre_attn_scalar"] = round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-9) else scalar
        out["attn_logit_softcapping"] = cfg.attn_logit_softcap or None
        out["final_logit_softcapping"] = cfg.final_logit_softcap or None
    return out


def math_fields(cfg: ModelConfig) -> dict[str, Any]:
    """cfg's fields that change what the model computes, in one spelling per meaning."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    local = cfg.local_layers
    out["attention_scale"] = round(cfg.attention_scale or cfg.head_dim**-0.5, 12)
    out["layer_pattern"] = layer_pattern(list(local)) if any(local) else ""
    out["sliding_window"] = cfg.sliding_window if any(local) else 0
    if not any(local) or (not cfg.local_rope_theta and cfg.rope_scaling is None):
        out["local_rope_theta"] = cfg.rope_theta if any(local) else 0.0
    return out


def to_hf_config(cfg: ModelConfig, weights_dtype: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dict of cfg's family; `weights_dtype` names the dtype of the weights
    written beside it (default float32). A model the family's config cannot express is refused in one line."""
    fam = FAMILY[cfg.family]
    out: dict[str, Any] = {
        "architectures": [fam.arch],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.mlp_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_parameters": write_rope(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        **_family_fields(cfg, fam),
        "torch_dtype": "float32",
    }
    if weights_dtype is not None:
        out["torch_dtype"] = out["dtype"] = weights_dtype
    want, got = math_fields(cfg), math_fields(from_hf_config(out))
    if bad := [k for k in want if want[k] != got[k]]:
        changes = ", ".join(f"--model.{k}={want[k]!r}" for k in bad)
        raise UsageError(
            f"model_type {cfg.family!r} cannot hold {changes} (its config.json would give "
            f"{', '.join(f'{k}={got[k]!r}' for k in bad)}); set --model.family to a family that has it"
        )
    return out


__all__ = ["FAMILY", "from_hf_config", "layer_pattern", "math_fields", "read_hf_config", "to_hf_config"]
