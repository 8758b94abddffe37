"""Model FLOPs of local (sliding-window) layers: each query counts only the keys of its window, and the
families' new weights (biases, q/k norms, post-norms) are in the 6N term."""

import pytest

from meshlm.flops import attended_keys, model_flops_per_token
from meshlm.models.configs import ModelConfig

# 2 layers, 8 heads x head_dim 8; attention per key: 3 (training) x 2 matmuls x 2 x 8 heads x 8 = 768 FLOPs.
CFG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, mlp_dim=128, max_seq_len=512)
PER_KEY = 3 * 2 * 2 * 8 * 8


def attention_flops(cfg, seq_len):
    return model_flops_per_token(cfg, seq_len) - 6 * cfg.num_params(include_embedding=False)


def test_attended_keys_counts_each_querys_window():
    # T = 8, W = 3: queries attend 1, 2, 3, 3, 3, 3, 3, 3 keys (mean 21/8), the diagonal counted half.
    assert attended_keys(8, 3) == 21 / 8 - 0.5
    assert attended_keys(8, 0) == attended_keys(8, 8) == attended_keys(8, 100) == 4.0  # global: T / 2
    assert attended_keys(8, 3, causal=False) == 8.0


@pytest.mark.parametrize("pattern", ["", "LG", "GL"])
def test_a_window_at_least_the_sequence_counts_as_global(pattern):
    for window in (128, 4096):
        local = CFG.replace(sliding_window=window, layer_pattern=pattern)
        assert model_flops_per_token(local, 128) == model_flops_per_token(CFG, 128)


def test_local_layers_count_only_their_window():
    seq_len, window = 1024, 64
    every_local = attention_flops(CFG.replace(sliding_window=window), seq_len)
    every_global = attention_flops(CFG, seq_len)
    alternating = attention_flops(CFG.replace(sliding_window=window, layer_pattern="LG"), seq_len)
    assert alternating == pytest.approx((every_local + every_global) / 2)
    assert every_global == 2 * PER_KEY * seq_len / 2
    keys = sum(min(p + 1, window) for p in range(seq_len)) / seq_len - 0.5  # ~ W, not T / 2
    assert every_local == pytest.approx(2 * PER_KEY * keys)
    assert every_local < every_global / 7


def test_the_families_weights_are_in_6n():
    qwen3_like = CFG.replace(qkv_bias=True, qk_norm=True, post_norms=True)
    extra = 2 * ((8 * 8 + 2 * 4 * 8) + 2 * 8 + 2 * 64)  # per layer: q/k/v biases, q and k norms, two post-norms
    assert qwen3_like.num_params() - CFG.num_params() == extra
    assert model_flops_per_token(qwen3_like, 128) - model_flops_per_token(CFG, 128) == 6 * extra
