"""Hugging Face `config.json` <-> `ModelConfig`: every family meshlm runs, read and written.

Every path that takes a config.json (`--model=`, `--init_from=hf:`, convert, serve) reads it with
`read_hf_config`, so a config meshlm cannot run gets the same one-line error everywhere; `to_hf_config`
writes the family's own config for export. The weights' names are `meshlm.checkpoint.hf_map`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshlm.errors import UsageError, closest
from meshlm.models.configs import ModelConfig, RopeScaling


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


__all__ = ["from_hf_config", "read_hf_config", "to_hf_config"]
