"""The open families train alike on every mesh: a Gemma-2-shaped and a Qwen-shaped tiny model, local
(sliding-window) layers mixed with global ones, trained 3 steps in float32, give the losses and final
parameters of one device: data, fsdp and tp together, RingAttention over sp=4 with windows shorter than
a sequence shard (chunks wholly outside the window are skipped), and per-layer-range strategies whose
boundary splits the local/global pattern.

Each (model, mesh) compiles one train step; every run starts from the state made once on one device."""

import jax
import numpy as np
import pytest

from meshlm.models.presets import resolve_model
from meshlm.optimizer import OptimizerConfig
from tests.support.training import make_batches, run

SEQ = 64  # sp=4 in zigzag order: 8 chunks of 8 positions, two per device (a shard of 16)
BASE = dict(vocab_size=512, d_model=64, n_heads=8, mlp_dim=128, max_seq_len=512, norm_eps=1e-6)
FAMILIES = {
    # Gemma 2: (1 + w) norms before and after attention and MLP, sqrt(d) embeddings, GeGLU, a score scale
    # other than 1/sqrt(head_dim), both soft-caps, alternating local and global layers, a tied head.
    "gemma2": dict(
        family="gemma2",
        n_layers=4,
        n_kv_heads=4,
        head_dim=16,
        post_norms=True,
        norm_offset=1.0,
        embed_scale=True,
        mlp_activation="gelu_tanh",
        attention_scale=32**-0.5,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        sliding_window=16,
        layer_pattern="LG",
        tie_embeddings=True,
    ),
    # Qwen: RMSNorm on queries and keys (Qwen 3) and q/k/v biases (Qwen 2.5); two local layers of window 8
    # (one ring chunk) and a global one.
    "qwen": dict(
        family="qwen3",
        n_layers=3,
        n_kv_heads=2,
        qk_norm=True,
        qkv_bias=True,
        rope_theta=1e6,
        sliding_window=8,
        layer_pattern="LLG",
    ),
}
# Adam with eps = 1 moves each weight by lr times its (smoothed) gradient: the final weights differ between
# meshes only as the gradients do. (With eps = 1e-8 a gradient element near 0 turns float rounding into up
# to a whole step of lr: plain LLaMA's weights then differ by 5e-5 between 1,1,1,1 and 1,2,1,4.)
OPT = OptimizerConfig(lr=1.0, warmup_steps=1, total_steps=10, eps=1.0)
# Layer 0 data parallel, layers 1-3 by the default table: the second group starts on a global layer.
GROUPS = """
[[layers]]
range = [0, 0]
strategy = "dp"
"""


def _config(family: str):
    return resolve_model("test", {}).replace(**BASE, **FAMILIES[family])


_runs: dict = {}


def trained(family: str, dims: str, rules_file=None) -> dict:
    """3 steps of `family` on `dims`: losses and the final parameters (one-stack tree, on the host)."""
    key = (family, dims, rules_file)
    if key not in _runs:
        cfg = _config(family)
        got = run(
            dims, cfg, OPT, batches=make_batches(cfg, seq=SEQ), shared_init=rules_file is None, rules_file=rules_file
        )
        params = jax.device_get(got["placement"].canonical(got["state"].params))
        _runs[key] = dict(losses=got["losses"], params=params)
    return _runs[key]


def assert_same_training(got: dict, want: dict) -> None:
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got["params"]), jax.tree.leaves(want["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "family, dims",
    [
        ("qwen", "1,2,1,4"),  # the ring over local layers of one chunk's window
        pytest.param("gemma2", "1,2,1,4", marks=pytest.mark.slow),
        pytest.param("gemma2", "2,2,2,1", marks=pytest.mark.slow),
        pytest.param("qwen", "2,2,2,1", marks=pytest.mark.slow),
    ],
)
def test_family_trains_on_a_mesh_as_on_one_device(family, dims):
    assert_same_training(trained(family, dims), trained(family, "1,1,1,1"))


@pytest.mark.slow
def test_layer_groups_split_the_local_global_pattern(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text(GROUPS)
    assert_same_training(trained("gemma2", "2,2,2,1", str(rules)), trained("gemma2", "1,1,1,1"))


def test_training_moves_every_weight_and_lowers_the_loss():
    """The comparison above means something: the weights the families add (biases, q/k norms) train."""
    got = trained("qwen", "1,1,1,1")
    assert got["losses"][-1] < got["losses"][0], got["losses"]
    layers = got["params"]["layers"]["attn"]
    for name in ("bq", "bk", "bv"):
        assert np.abs(layers[name]).max() > 0, name
    assert np.abs(layers["q_norm"]["scale"] - 1).max() > 0
