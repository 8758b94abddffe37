"""config.json of every family read in transformers 4's and 5's spellings, family defaults, and what is refused
(one line each); export refuses a model its family cannot express."""

import pytest

from meshlm.errors import UsageError
from meshlm.models.configs import RopeScaling
from meshlm.models.hf_config import from_hf_config, layer_pattern, to_hf_config

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)


def hf(model_type, **fields):
    return {"model_type": model_type, **SHAPE, **fields}


def error_of(fn, *args) -> str:
    with pytest.raises(UsageError) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "kinds, pattern",
    [("LGLG", "LG"), ("LLLLLGLLLLLGLL", "LLLLLG"), ("GGLL", "GGLL"), ("LLGL", "LLG"), ("LLLL", ""), ("GLG", "GL")],
)
def test_layer_types_become_the_shortest_repeating_pattern(kinds, pattern):
    assert layer_pattern([k == "L" for k in kinds]) == pattern
    types = ["sliding_attention" if k == "L" else "full_attention" for k in kinds]
    fields = dict(SHAPE, num_hidden_layers=len(kinds), layer_types=types, sliding_window=8)
    cfg = from_hf_config({"model_type": "gemma2", **fields})
    assert cfg.local_layers == tuple(k == "L" for k in kinds) and cfg.layer_pattern == pattern


def test_transformers_4_spellings_and_family_defaults():
    """Fields left out take the transformers config class's default; old spellings read the same."""
    gemma2 = from_hf_config(hf("gemma2", num_hidden_layers=3, head_dim=16))  # no layer_types: alternates from local
    assert (gemma2.layer_pattern, gemma2.sliding_window) == ("LG", 4096)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.tie_embeddings) == (50.0, 30.0, True)
    assert gemma2.attention_scale == 256**-0.5 and gemma2.mlp_activation == "gelu_tanh"
    gemma3 = from_hf_config(
        hf("gemma3_text", num_hidden_layers=8, sliding_window_pattern=4, rope_local_base_freq=5000.0,
           rope_theta=2e6, rope_scaling={"type": "linear", "factor": 8.0})
    )  # fmt: skip
    assert gemma3.layer_pattern == "LLLG" and gemma3.head_dim == 256 and gemma3.attention_scale == 0.0
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (2e6, 5000.0)
    assert gemma3.rope_scaling == RopeScaling(8.0, kind="linear")
    assert from_hf_config(hf("gemma3_text")).rope_theta == 1e6  # Gemma 3's own default
    legacy_gemma = from_hf_config(hf("gemma", hidden_act="gelu"))  # transformers reads it as the tanh gelu
    assert legacy_gemma.mlp_activation == "gelu_tanh" and legacy_gemma.norm_offset == 1.0
    qwen = from_hf_config(hf("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=3))
    assert (qwen.layer_pattern, qwen.qkv_bias, qwen.out_bias) == ("GGGL", True, False)
    assert from_hf_config(hf("qwen2", sliding_window=16)).sliding_window == 0  # use_sliding_window defaults false
    assert from_hf_config(hf("qwen3")).head_dim == 128
    assert from_hf_config(hf("mistral")).sliding_window == 4096
    assert from_hf_config(hf("mistral", sliding_window=None)).sliding_window == 0
    yarn = from_hf_config(
        hf("llama", rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5})
    )
    assert yarn.rope_theta == 5e5 and yarn.rope_scaling.kind == "yarn"
    assert yarn.rope_scaling.original_max_position_embeddings == 2048  # the family's max_position_embeddings
    assert yarn.rope_scaling.attention_factor == pytest.approx((0.1 * 1.386294 + 1) / (0.05 * 1.386294 + 1), 1e-6)
    both = hf("llama", rope_parameters={"rope_type": "default", "rope_theta": 7.0}, rope_scaling={"type": "linear"})
    assert "needs a 'factor'" in error_of(from_hf_config, both)  # rope_scaling wins, as in transformers


def test_gemma3_with_images_reads_its_text_model():
    image_text = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "head_dim": 16},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    cfg = from_hf_config(image_text)
    assert (cfg.family, cfg.vocab_size, cfg.n_heads, cfg.layer_pattern) == ("gemma3_text", 262_208, 8, "LLLLLG")
    assert to_hf_config(cfg)["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.parametrize(
    "config, says",
    [
        (hf("mixtral"), "model_type='mixtral' is not a family meshlm runs; it runs llama, mistral, qwen2, qwen3"),
        (hf("qwen2_moe"), "model_type='qwen2_moe' is not a family"),
        (hf("deepseek_v3"), "model_type='deepseek_v3' is not a family"),
        (hf("gemma3", text_config=None), "model_type='gemma3' is not a family"),
        (hf("llama", rope_scaling={"rope_type": "longrope"}), "rope type 'longrope' is not supported; meshlm runs"),
        (hf("qwen2", hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (hf("gemma2", hidden_activation="relu"), "hidden_activation='relu' is not supported"),
        (hf("gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention=true"),
        (
            hf("gemma3_text", rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
            "rope scaling on sliding-window layers",
        ),
        (hf("gemma2", layer_types=["full_attention"] * 3), "layer_types must list"),
        (hf("qwen3", num_attention_heads=None), "lacks the field 'num_attention_heads' that a Qwen3Config has"),
    ],
)
def test_what_meshlm_does_not_run_is_one_line(config, says):
    if config.get("num_attention_heads", 0) is None:
        del config["num_attention_heads"]
    assert says in error_of(from_hf_config, config, "config.json")


@pytest.mark.parametrize(
    "family, change, field",
    [
        ("llama", dict(qk_norm=True), "qk_norm"),
        ("mistral", dict(qkv_bias=True), "qkv_bias"),
        ("qwen2", dict(out_bias=True), "out_bias"),
        ("llama", dict(final_logit_softcap=30.0), "final_logit_softcap"),
        ("mistral", dict(sliding_window=8, layer_pattern="LG"), "layer_pattern"),
        ("gemma3_text", dict(mlp_bias=True), "mlp_bias"),
    ],
)
def test_export_refuses_what_the_family_cannot_express(family, change, field):
    good = from_hf_config(hf(family, num_key_value_heads=2))
    assert from_hf_config(to_hf_config(good)) == good
    says = error_of(to_hf_config, good.replace(**change))
    assert says.startswith(f"model_type {family!r} cannot hold --model.{field}=") and "--model.family" in says
