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

# What every size of a family shares, as its config.json spells it.
LLAMA3_1 = dict(max_seq_len=131072, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192))
QWEN2 = dict(family="qwen2", qkv_bias=True, rope_theta=1e6, norm_eps=1e-6)
QWEN3 = dict(family="qwen3", qk_norm=True, head_dim=128, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6)
GEMMA = dict(
    head_dim=256, norm_eps=1e-6, tie_embeddings=True, post_norms=True, norm_offset=1.0, embed_scale=True,
    mlp_activation="gelu_tanh",
)  # fmt: skip
GEMMA2 = GEMMA | dict(
    family="gemma2", max_seq_len=8192, attn_logit_softcap=50.0, final_logit_softcap=30.0, sliding_window=4096,
    layer_pattern="LG",
)  # fmt: skip
GEMMA3 = GEMMA | dict(
    family="gemma3_text", qk_norm=True, layer_pattern="LLLLLG", rope_theta=1e6, local_rope_theta=10000.0
)  # fmt: skip

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
    # The open families' published shapes, each as its Hugging Face config.json gives it
    # (tests/models/test_presets_families.py holds the config.json fields and the published parameter counts).
    "llama3.1-8b": ModelConfig(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, mlp_dim=14336, **LLAMA3_1
    ),
    "llama3.1-70b": ModelConfig(
        vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, mlp_dim=28672, **LLAMA3_1
    ),
    "mistral-7b": ModelConfig(
        vocab_size=32768,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        mlp_dim=14336,
        max_seq_len=32768,
        rope_theta=1e6,
        family="mistral",
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936,
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        mlp_dim=4864,
        max_seq_len=32768,
        tie_embeddings=True,
        **QWEN2,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        mlp_dim=18944,
        max_seq_len=131072,
        **QWEN2,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        mlp_dim=3072,
        tie_embeddings=True,
        **QWEN3,
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, mlp_dim=12288, **QWEN3
    ),
    "qwen3-32b": ModelConfig(
        vocab_size=151936, d_model=5120, n_layers=64, n_heads=64, n_kv_heads=8, mlp_dim=25600, **QWEN3
    ),
    "gemma-2-9b": ModelConfig(
        vocab_size=256000, d_model=3584, n_layers=42, n_heads=16, n_kv_heads=8, mlp_dim=14336, **GEMMA2
    ),
    "gemma-3-1b": ModelConfig(
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        mlp_dim=6912,
        max_seq_len=32768,
        sliding_window=512,
        **GEMMA3,
    ),
    # Gemma 3 12B's text model (Gemma3ForConditionalGeneration's text_config; the vision tower is not built).
    "gemma-3-12b": ModelConfig(
        vocab_size=262208,
        d_model=3840,
        n_layers=48,
        n_heads=16,
        n_kv_heads=8,
        mlp_dim=15360,
        max_seq_len=131072,
        sliding_window=1024,
        rope_scaling=RopeScaling(8.0, kind="linear"),
        **GEMMA3,
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
