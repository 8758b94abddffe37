"""Every family's Hugging Face folder in and out: config.json read and written so transformers builds the same
model, tensors back exactly, and meshlm's logits equal transformers' on one device."""

import json

import jax
import numpy as np
import pytest

from meshlm.checkpoint.convert import convert_from_hf, convert_to_hf
from meshlm.checkpoint.hf_map import leaves
from meshlm.checkpoint.params_folder import PARAMS_FILE
from meshlm.checkpoint.weights import load_params
from meshlm.models.hf_config import from_hf_config, read_hf_config, to_hf_config
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from tests.support.hf import mesh_of, meshlm_logits, torch_logits
from tests.support.hf_families import FAMILY_NAMES, tokens_longer_than_the_window, torch_family

F32 = RunPolicy(dtype="float32")

# What each case's config.json must turn on (tests/support/hf_families.py builds the cases).
EXPECTED = {
    "llama": dict(qkv_bias=True, out_bias=True, mlp_bias=True, head_dim=24),
    "mistral": dict(sliding_window=8, layer_pattern=""),
    "qwen2": dict(qkv_bias=True, out_bias=False, tie_embeddings=True, sliding_window=8, layer_pattern="GGLL"),
    "qwen3": dict(qk_norm=True, head_dim=24, layer_pattern="LG"),
    "gemma": dict(norm_offset=1.0, embed_scale=True, mlp_activation="gelu_tanh", tie_embeddings=True),
    "gemma2": dict(post_norms=True, attention_scale=20**-0.5, attn_logit_softcap=2.0, final_logit_softcap=3.0),
    "gemma3_text": dict(qk_norm=True, post_norms=True, layer_pattern="LLG", local_rope_theta=10_000.0),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One tiny random model per family, saved by transformers once for the module."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(family):
        if family not in built:
            model = torch_family(family)
            model.save_pretrained(root / family)
            built[family] = (model, root / family)
        return built[family]

    return get


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_config_round_trip_builds_the_same_model_in_transformers(family, models):
    import torch
    import transformers

    model, folder = models(family)
    cfg = read_hf_config(folder / "config.json")
    assert cfg.family == family
    assert {k: getattr(cfg, k) for k in EXPECTED[family]} == EXPECTED[family]
    ours = to_hf_config(cfg)
    assert from_hf_config(ours) == cfg
    assert ours["architectures"] == model.config.architectures
    rebuilt = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**ours), attn_implementation="eager"
    ).eval()
    rebuilt.load_state_dict(model.state_dict())  # strict: the same tensors, no more, no fewer
    tokens = torch.as_tensor(tokens_longer_than_the_window(cfg.vocab_size))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens).logits, model(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_weights_in_and_out_are_transformers_tensors(family, models, tmp_path):
    from safetensors.numpy import load_file

    model, folder = models(family)
    params = convert_from_hf(folder, tmp_path / "p")
    cfg = read_hf_config(params / "config.json")
    stored = load_file(str(params / PARAMS_FILE))
    assert set(stored) == {leaf.name for leaf in leaves(cfg)}
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if cfg.qkv_bias:  # a bias lands per head: [H*D] -> [H, D]
        np.testing.assert_array_equal(
            stored["layers.attn.bq"][1], state["model.layers.1.self_attn.q_proj.bias"].reshape(cfg.n_heads, -1)
        )
    if cfg.post_norms:
        np.testing.assert_array_equal(
            stored["layers.mlp_norm.scale"][2], state["model.layers.2.pre_feedforward_layernorm.weight"]
        )
    back = load_file(str(convert_to_hf(params, tmp_path / "hf") / "model.safetensors"))
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")  # transformers' state dict shows the tied head; the files do not hold it
    assert set(back) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family


def built_shapes(placement) -> dict[str, tuple[int, ...]]:
    """The decoder's parameter tree as hf_map names its leaves."""
    leaves_with_path = jax.tree_util.tree_leaves_with_path(placement.shapes)
    return {jax.tree_util.keystr(p, simple=True, separator="."): tuple(s.shape) for p, s in leaves_with_path}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_match_transformers(family, models):
    model, folder = models(family)
    cfg = read_hf_config(folder / "config.json")
    placement = place(cfg, mesh_of("1,1,1,1"), policy=F32)
    assert built_shapes(placement) == {leaf.name: leaf.full_shape for leaf in leaves(cfg)}
    params = load_params(f"hf:{folder}", placement)
    tokens = tokens_longer_than_the_window(cfg.vocab_size)
    want = torch_logits(model, tokens)
    assert want.std() > 0.3
    np.testing.assert_allclose(meshlm_logits(placement, params, tokens), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "family, mesh_dim",
    [("gemma2", "2,1,1,4"), ("qwen2", "1,2,2,2"), pytest.param("gemma3_text", "1,1,2,4", marks=pytest.mark.slow)],
)
def test_logits_match_transformers_on_a_mixed_mesh_with_ring_attention(family, mesh_dim, models):
    """Sequence parallelism over local and global layers (RingAttention with the window, soft caps and
    the family's scale), data and tensor parallelism beside it: transformers' logits still."""
    model, folder = models(family)
    cfg = read_hf_config(folder / "config.json")
    placement = place(cfg, mesh_of(mesh_dim), policy=F32)
    assert placement.mesh.shape["sp"] > 1
    tokens = tokens_longer_than_the_window(cfg.vocab_size)
    got = meshlm_logits(placement, load_params(f"hf:{folder}", placement), tokens)
    np.testing.assert_allclose(got, torch_logits(model, tokens), atol=1e-4, rtol=0)
