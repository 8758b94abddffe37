"""The open families' presets against what their publishers give: the Hugging Face config.json (the fields
that shape the model, copied from each model's config.json on the Hugging Face Hub) read by
`from_hf_config` is the preset, field for field; and the preset's parameter count is the published one
within 1%."""

import pytest

from meshlm.models.hf_config import from_hf_config
from meshlm.models.presets import PRESETS

LLAMA3_1_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
                     rope_type="llama3")  # fmt: skip
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, head_dim=128,
             hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000,
             sliding_window=None, use_sliding_window=False, vocab_size=151936)  # fmt: skip
QWEN2_5 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
               rope_theta=1000000.0, use_sliding_window=False)  # fmt: skip
GEMMA3_TEXT = dict(model_type="gemma3_text", attention_bias=False, attn_logit_softcapping=None,
                   final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_local_base_freq=10000.0, rope_theta=1000000.0,
                   sliding_window_pattern=6)  # fmt: skip

# preset: (its config.json as published, the published parameter count, where that count is published)
PUBLISHED = {
    "llama3.1-8b": (
        dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, hidden_act="silu",
             hidden_size=4096, intermediate_size=14336, max_position_embeddings=131072, mlp_bias=False,
             num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-5,
             rope_scaling=LLAMA3_1_ROPE, rope_theta=500000.0, tie_word_embeddings=False, vocab_size=128256),
        8.03e9, "meta-llama/Llama-3.1-8B on the Hugging Face Hub: 8.03B params (safetensors)",
    ),
    "llama3.1-70b": (
        dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, hidden_act="silu",
             hidden_size=8192, intermediate_size=28672, max_position_embeddings=131072, mlp_bias=False,
             num_attention_heads=64, num_hidden_layers=80, num_key_value_heads=8, rms_norm_eps=1e-5,
             rope_scaling=LLAMA3_1_ROPE, rope_theta=500000.0, tie_word_embeddings=False, vocab_size=128256),
        70.6e9, "meta-llama/Llama-3.1-70B on the Hugging Face Hub: 70.6B params (safetensors)",
    ),
    "mistral-7b": (
        dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu", hidden_size=4096,
             intermediate_size=14336, max_position_embeddings=32768, num_attention_heads=32, num_hidden_layers=32,
             num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
             tie_word_embeddings=False, vocab_size=32768),
        7.25e9, "mistralai/Mistral-7B-v0.3 on the Hugging Face Hub: 7.25B params (safetensors)",
    ),
    "qwen2.5-0.5b": (
        QWEN2_5 | dict(hidden_size=896, intermediate_size=4864, max_position_embeddings=32768, max_window_layers=24,
                       num_attention_heads=14, num_hidden_layers=24, num_key_value_heads=2, sliding_window=32768,
                       tie_word_embeddings=True, vocab_size=151936),
        0.49e9, "Qwen/Qwen2.5-0.5B model card: Number of Parameters: 0.49B",
    ),
    "qwen2.5-7b": (
        QWEN2_5 | dict(hidden_size=3584, intermediate_size=18944, max_position_embeddings=131072, max_window_layers=28,
                       num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4, sliding_window=131072,
                       tie_word_embeddings=False, vocab_size=152064),
        7.61e9, "Qwen/Qwen2.5-7B model card: Number of Parameters: 7.61B",
    ),
    "qwen3-0.6b": (
        QWEN3 | dict(hidden_size=1024, intermediate_size=3072, max_window_layers=28, num_attention_heads=16,
                     num_hidden_layers=28, num_key_value_heads=8, tie_word_embeddings=True),
        0.6e9, "Qwen/Qwen3-0.6B model card: Number of Parameters: 0.6B",
    ),
    "qwen3-8b": (
        QWEN3 | dict(hidden_size=4096, intermediate_size=12288, max_window_layers=36, num_attention_heads=32,
                     num_hidden_layers=36, num_key_value_heads=8, tie_word_embeddings=False),
        8.2e9, "Qwen/Qwen3-8B model card: Number of Parameters: 8.2B",
    ),
    "qwen3-32b": (
        QWEN3 | dict(hidden_size=5120, intermediate_size=25600, max_window_layers=64, num_attention_heads=64,
                     num_hidden_layers=64, num_key_value_heads=8, tie_word_embeddings=False),
        32.8e9, "Qwen/Qwen3-32B model card: Number of Parameters: 32.8B",
    ),
    "gemma-2-9b": (
        dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", attention_bias=False,
             attn_logit_softcapping=50.0, final_logit_softcapping=30.0, head_dim=256,
             hidden_activation="gelu_pytorch_tanh", hidden_size=3584, intermediate_size=14336,
             max_position_embeddings=8192, num_attention_heads=16, num_hidden_layers=42, num_key_value_heads=8,
             query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096,
             vocab_size=256000),
        917_504_000 + 8_324_201_984, "Gemma 2 technical report, parameter table: 917,504,000 embedding + "
        "8,324,201,984 non-embedding parameters",
    ),
    "gemma-3-1b": (
        GEMMA3_TEXT | dict(architectures=["Gemma3ForCausalLM"], hidden_size=1152, intermediate_size=6912,
                           max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26,
                           num_key_value_heads=1, rope_scaling=None, sliding_window=512, vocab_size=262144),
        302e6 + 698e6, "Gemma 3 technical report, Table 1: 302M embedding + 698M non-embedding parameters",
    ),
    "gemma-3-12b": (
        dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=GEMMA3_TEXT | dict(
            hidden_size=3840, intermediate_size=15360, max_position_embeddings=131072, num_attention_heads=16,
            num_hidden_layers=48, num_key_value_heads=8, rope_scaling=dict(factor=8.0, rope_type="linear"),
            sliding_window=1024, vocab_size=262208)),
        1_012e6 + 10_759e6, "Gemma 3 technical report, Table 1: 1,012M embedding + 10,759M non-embedding "
        "parameters of the language model (the 417M vision encoder is not built)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_is_the_published_config(name):
    hf, _, _ = PUBLISHED[name]
    assert PRESETS[name] == from_hf_config(hf, f"{name} config.json")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_the_published_parameter_count(name):
    _, published, source = PUBLISHED[name]
    counted = PRESETS[name].num_params()
    assert abs(counted - published) <= 0.01 * published, f"{name}: {counted:,} against {published:,.0f} ({source})"


def test_the_family_presets_set_what_the_family_differs_by():
    gemma2, gemma3, qwen2, qwen3 = (PRESETS[n] for n in ("gemma-2-9b", "gemma-3-12b", "qwen2.5-7b", "qwen3-8b"))
    assert gemma2.local_layers[:4] == (True, False, True, False) and gemma2.pattern_period == 2
    assert gemma3.local_layers[:6] == (True,) * 5 + (False,) and gemma3.local_rope_theta == 10000.0
    assert gemma3.rope_scaling is not None and gemma3.rope_scaling.kind == "linear"
    assert qwen2.qkv_bias and not qwen2.out_bias and qwen3.qk_norm and not qwen3.qkv_bias
    assert PRESETS["mistral-7b"].sliding_window == 0 and PRESETS["llama3.1-70b"].rope_scaling.factor == 8.0
