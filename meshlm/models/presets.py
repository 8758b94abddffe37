"""Named model presets, and `resolve_model`: what `--model` names (a preset or a config.json) becomes.

`resolve_model("tiny", {"n_layers": "6"})` is what `--model=tiny --model.n_layers=6` becomes;
`resolve_model("path/to/config.json")` (or its folder) reads a Hugging Face config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, RopeScaling, apply_overrides
from meshlm.models.hf_config import read_hf_config

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


__all__ = ["PRESETS", "resolve_model"]
