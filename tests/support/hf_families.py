"""Tiny random transformers models of every family meshlm maps, each turning on what its family differs by."""

import numpy as np
import pytest

from tests.support.hf import small_hf_config

BASE = small_hf_config(vocab_size=160, num_hidden_layers=4, max_position_embeddings=128, rms_norm_eps=1e-6)
SLIDING, FULL = "sliding_attention", "full_attention"

# transformers config class name and the fields each case sets beyond BASE.
FAMILY_CASES = {
    "llama": (
        "LlamaConfig",
        dict(head_dim=24, attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0}),
    ),
    "mistral": (
        "MistralConfig",
        dict(
            sliding_window=8,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=2, tie_word_embeddings=True),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(head_dim=24, use_sliding_window=True, sliding_window=8, layer_types=[SLIDING, FULL] * 2),
    ),
    "gemma": ("GemmaConfig", dict(head_dim=24, tie_word_embeddings=True)),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=20,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),  # fmt: skip
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=24,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=[SLIDING, SLIDING, FULL, SLIDING],
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
}
FAMILY_NAMES = list(FAMILY_CASES)


def family_config(family: str):
    transformers = pytest.importorskip("transformers")
    cls, fields = FAMILY_CASES[family]
    return getattr(transformers, cls)(**(BASE | fields), attn_implementation="eager")


def torch_family(family: str, seed: int = 0):
    """A random model of the family, every norm weight and bias randomized: plain norms 1 + N(0, 0.1), Gemma's
    raw w N(0, 0.1), biases N(0, 0.1), weights N(0, 0.15)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if family.startswith("gemma") else 1.0))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    return model


def tokens_longer_than_the_window(vocab: int, seed: int = 0) -> np.ndarray:
    """[2, 24] tokens: three times the cases' sliding window of 8."""
    return np.random.default_rng(seed).integers(0, vocab, (2, 24)).astype(np.int32)
