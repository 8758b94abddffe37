"""The model's math on one device: causality, documents, GQA, RoPE, remat, tied embeddings, configs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.axes import LOGICAL_AXES
from meshlm.errors import UsageError
from meshlm.mesh import MeshShape, build_mesh
from meshlm.models.decoder import REMAT_POLICIES
from meshlm.models.hf_config import from_hf_config, to_hf_config
from meshlm.models.placement import place
from meshlm.models.presets import PRESETS, resolve_model
from meshlm.models.rope import apply_rope, rope_frequencies

CFG = resolve_model("test", {"n_kv_heads": "2", "n_layers": "2"}).replace(dtype="float32")
MESH = None


def one_device():
    global MESH
    if MESH is None:
        MESH = build_mesh(MeshShape(), jax.devices()[:1])
    return MESH


def logits_fn(cfg):
    placement = place(cfg, one_device())
    params = placement.init(seed=0)
    return placement, params, jax.jit(lambda p, t, pos=None, seg=None: placement.apply(p, t, pos, seg))


@pytest.fixture(scope="module")
def model():
    return logits_fn(CFG)


def tokens(shape=(2, 16), seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, shape), jnp.int32)


def test_parameter_count_matches_the_formula(model):
    placement, params, _ = model
    assert sum(x.size for x in jax.tree.leaves(params)) == CFG.num_params()
    tied = place(CFG.replace(tie_embeddings=True), one_device())
    assert sum(np.prod(s.shape) for s in jax.tree.leaves(tied.shapes)) == CFG.replace(tie_embeddings=True).num_params()
    assert "lm_head" not in tied.shapes


def test_parameters_name_logical_axes_only(model):
    placement, _, _ = model
    named = {name for spec in jax.tree.leaves(placement.logical, is_leaf=lambda x: isinstance(x, P)) for name in spec}
    assert named - {None} <= set(LOGICAL_AXES) and "layers" in named, named


def test_causal_future_tokens_do_not_change_the_past(model):
    _, params, f = model
    a = tokens()
    b = a.at[:, 10:].set((a[:, 10:] + 1) % CFG.vocab_size)
    la, lb = f(params, a), f(params, b)
    np.testing.assert_allclose(la[:, :10], lb[:, :10], atol=1e-5)
    assert not np.allclose(la[:, 10:], lb[:, 10:], atol=1e-3)


def test_documents_do_not_see_each_other(model):
    """A packed second document gives the same logits as the same document alone."""
    _, params, f = model
    doc1, doc2 = tokens((1, 6), seed=1), tokens((1, 10), seed=2)
    packed = jnp.concatenate([doc1, doc2], axis=1)
    positions = jnp.asarray([list(range(6)) + list(range(10))], jnp.int32)
    segments = jnp.asarray([[1] * 6 + [2] * 10], jnp.int32)
    np.testing.assert_allclose(f(params, packed, positions, segments)[:, 6:], f(params, doc2), atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads(model):
    """GQA with K kv heads is MHA whose k/v weights repeat each kv head H/K times."""
    _, params, f = model
    mha_cfg = CFG.replace(n_kv_heads=CFG.n_heads)
    mha_placement = place(mha_cfg, one_device())
    rep = CFG.n_heads // CFG.n_kv_heads
    mha_params = jax.tree.map(lambda x: x, params)
    for name in ("wk", "wv"):
        mha_params["layers"]["attn"][name] = jnp.repeat(params["layers"]["attn"][name], rep, axis=2)
    t = tokens()
    np.testing.assert_allclose(jax.jit(mha_placement.apply)(mha_params, t), f(params, t), atol=1e-5)


def test_rope_rotates_by_relative_position():
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    inv, _ = rope_frequencies(16, 10000.0, None)
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))

    def score(m, n):
        return float(jnp.sum(apply_rope(q, jnp.array([[m]]), inv) * apply_rope(k, jnp.array([[n]]), inv)))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_llama3_rope_scaling_bands():
    cfg = PRESETS["llama3.2-1b"]
    base, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta, None)
    scaled, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    wavelen = 2 * np.pi / base
    s = cfg.rope_scaling
    high = wavelen < s.original_max_position_embeddings / s.high_freq_factor
    low = wavelen > s.original_max_position_embeddings / s.low_freq_factor
    np.testing.assert_allclose(scaled[high], base[high])  # short wavelengths untouched
    np.testing.assert_allclose(scaled[low], base[low] / s.factor, rtol=1e-6)  # long ones slowed by the factor
    mid = ~high & ~low
    assert mid.any() and np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / s.factor)


def remat_loss_and_grads(params, cfg):
    pl = place(cfg, one_device())
    t = tokens()
    return jax.jit(jax.value_and_grad(lambda p: jnp.mean(pl.apply(p, t) ** 2)))(params)


@pytest.fixture(scope="module")
def without_remat(model):
    """The loss and gradients of CFG (remat none: every activation kept), compiled once for every policy below."""
    return remat_loss_and_grads(model[1], CFG)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_policies_change_memory_not_math(model, without_remat, policy):
    (l0, g0), (l1, g1) = without_remat, remat_loss_and_grads(model[1], CFG.replace(remat=policy))
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_bfloat16_compute_keeps_float32_params_and_logits(model):
    placement, params, _ = model
    pl = place(CFG.replace(dtype="bfloat16"), one_device())
    out = jax.jit(pl.apply)(params, tokens())
    assert out.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_presets_and_overrides():
    assert resolve_model("tiny", {"n_layers": "6"}).n_layers == 6
    assert resolve_model("llama3-8b").n_kv_heads == 8 and resolve_model("llama3-8b").rope_theta == 500000.0
    assert 6.6e9 < PRESETS["llama2-7b"].num_params() < 6.8e9
    assert 7.9e9 < PRESETS["llama3-8b"].num_params() < 8.1e9
    assert 68e9 < PRESETS["llama2-70b"].num_params() < 70e9
    assert resolve_model("tiny", {"d_model": "512"}).head_dim == 128
    assert resolve_model("tiny", {"tie_embeddings": "true"}).tie_embeddings is True
    with pytest.raises(UsageError, match="unknown model field"):
        resolve_model("tiny", {"layers": "3"})
    with pytest.raises(UsageError, match="not a multiple of n_kv_heads"):
        resolve_model("tiny", {"n_kv_heads": "3"})


def test_hf_config_round_trip(tmp_path):
    for name in ("llama3.2-1b", "llama2-70b", "tiny"):
        cfg = PRESETS[name]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(to_hf_config(cfg)))
        back = resolve_model(str(path))
        assert back == cfg.replace(dtype=back.dtype, param_dtype=back.param_dtype, remat=back.remat)
    with pytest.raises(UsageError, match="lacks the field"):
        from_hf_config({"model_type": "llama"})
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(UsageError, match="not valid JSON"):
        resolve_model(str(tmp_path / "bad.json"))
