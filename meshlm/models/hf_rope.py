"""RoPE settings in a Hugging Face `config.json`, read and written.

Read in every spelling transformers 4 and 5 use: a top-level `rope_theta` with `rope_scaling` ({"type" or
"rope_type", "factor", ...}), transformers 5's `rope_parameters` (theta and scaling in one dict; a
`rope_scaling` dict wins over it, as in transformers), and Gemma 3's per-layer-type dict
({"full_attention": {...}, "sliding_attention": {...}}) or its older `rope_local_base_freq`.
Written in transformers 5's spelling (`rope_parameters`).
"""

from __future__ import annotations

import math
from typing import Any

from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, RopeScaling

RUNS = ("default", "llama3", "linear", "yarn")  # the rope types meshlm runs
LAYER_KINDS = ("full_attention", "sliding_attention")


def _scaling(params: dict[str, Any], max_pos: int, where: str) -> RopeScaling | None:
    """The RopeScaling of one flat rope dict; None for plain RoPE."""
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in RUNS:
        raise UsageError(f"{where}: rope type {kind!r} is not supported; meshlm runs {', '.join(RUNS)}")
    if kind == "default":
        return None
    original = int(params.get("original_max_position_embeddings") or max_pos)
    factor = params.get("factor")
    if factor is None and kind == "yarn":
        factor = max_pos / original
    if factor is None:
        raise UsageError(f"{where}: rope type {kind!r} needs a 'factor'")
    factor = float(factor)
    if kind == "llama3":
        low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
        return RopeScaling(factor, low, high, original)
    if kind == "linear":
        return RopeScaling(factor, kind="linear")
    attention = params.get("attention_factor")
    if attention is None:  # transformers' inference of yarn's cos/sin scale
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if factor <= 1:
            attention = 1.0
        elif mscale and mscale_all:
            attention = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all * math.log(factor) + 1)
    return RopeScaling(
        factor,
        original_max_position_embeddings=original,
        kind="yarn",
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=float(attention or 0.0),
        truncate=bool(params.get("truncate", True)),
    )


def read_rope(hf: dict[str, Any], family: str, max_pos: int, where: str) -> dict[str, Any]:
    """ModelConfig's rope_theta, rope_scaling and local_rope_theta from a config.json dict."""
    gemma3 = family == "gemma3_text"
    theta = hf.get("rope_theta") or (1_000_000.0 if gemma3 else 10_000.0)
    rp, rs = hf.get("rope_parameters"), hf.get("rope_scaling") or {}
    for name, value in (("rope_parameters", rp or {}), ("rope_scaling", rs)):
        if not isinstance(value, dict):
            raise UsageError(f"{where}: {name} must be a JSON object, not {value!r}")
    local: dict[str, Any] | None = None
    if rp and any(k in rp for k in LAYER_KINDS):  # one dict per layer type; rope_scaling updates the global one
        params = {**(rp.get("full_attention") or {}), **rs}
        local = rp.get("sliding_attention") or {}
    else:
        params = rs or rp or {}
        if gemma3:
            local = {"rope_theta": hf.get("rope_local_base_freq") or 10_000.0}
    out: dict[str, Any] = {
        "rope_theta": float(params.get("rope_theta") or theta),
        "rope_scaling": _scaling(params, max_pos, where),
        "local_rope_theta": 0.0,
    }
    if local is not None:
        if _scaling(local, max_pos, where) is not None:
            raise UsageError(f"{where}: rope scaling on sliding-window layers is not supported; scale global ones")
        out["local_rope_theta"] = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or 10_000.0)
        if not gemma3 and (out["local_rope_theta"], None) != (out["rope_theta"], out["rope_scaling"]):
            raise UsageError(f"{where}: model_type {family!r} has one RoPE for every layer, not one per layer type")
        if not gemma3:
            out["local_rope_theta"] = 0.0
    return out


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    out: dict[str, Any] = {"rope_type": scaling.kind, "rope_theta": theta, "factor": scaling.factor}
    if scaling.kind == "llama3":
        out |= {
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    elif scaling.kind == "yarn":
        out |= {
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "truncate": scaling.truncate,
        }
        if scaling.attention_factor:
            out["attention_factor"] = scaling.attention_factor
    return out


def write_rope(cfg: ModelConfig) -> dict[str, Any]:
    """The `rope_parameters` of cfg's config.json (per layer type for Gemma 3)."""
    glob = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
    if cfg.family != "gemma3_text":
        return glob
    local = _rope_dict(cfg.local_rope_theta or cfg.rope_theta, None)
    return {"full_attention": glob, "sliding_attention": local}


__all__ = ["read_rope", "write_rope", "RUNS"]
