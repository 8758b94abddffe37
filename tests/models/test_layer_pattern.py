"""Local and global layers by `layer_pattern`: the scanned layer loop (one repeat of the pattern per
iteration, and the layers after the last whole repeat) gives the logits and keys/values of the layers run
one by one (`Decoder.prefill`), and every `--remat` policy gives the loss and gradients of keeping every
activation when each scan iteration holds both kinds of layer. One device, float32."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from meshlm import sharding
from meshlm.models.decoder import REMAT_POLICIES
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.train.step import loss_sums
from tests.models.test_loss import _batch
from tests.support.training import mesh_for

SEQ = 32
# Gemma 2's numerics on the test shape: (1 + w) norms around attention and MLP, sqrt(d) embeddings, GeGLU,
# a score scale, both soft-caps, a tied head; windows of 8 positions, far shorter than the sequence. Three
# layers of "LG": local, global, local; the scan runs one repeat of the pattern, then a cut-short one.
CFG = resolve_model("test", {}).replace(
    family="gemma2", n_layers=3, n_kv_heads=4, head_dim=16, post_norms=True, norm_offset=1.0, embed_scale=True,
    mlp_activation="gelu_tanh", attention_scale=32**-0.5, attn_logit_softcap=50.0, final_logit_softcap=30.0,
    sliding_window=8, layer_pattern="LG", tie_embeddings=True, init_std=0.1,
)  # fmt: skip
F32 = RunPolicy(dtype="float32")
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, SEQ)).astype(np.int32)


@functools.cache
def _weights():
    return place(CFG, mesh_for("1,1,1,1"), policy=F32).init(seed=0)


def _scanned(cfg):
    """(logits, (keys, values)) of the scanned layer loop on `cfg`, with CFG's weights."""
    placement = place(cfg, mesh_for("1,1,1,1"), policy=F32)
    return jax.jit(lambda p, t: placement.apply(p, t, return_kv=True))(_weights(), TOKENS)


def _prefill(placement, params, tokens):
    with sharding.activate(placement.mesh, placement.strategy):
        return nnx.merge(placement.graphdef, params).prefill(tokens)


def test_three_layers_of_lg_are_local_global_local():
    assert CFG.local_layers == (True, False, True) and CFG.pattern_period == 2


def test_scanned_pattern_equals_layers_run_one_by_one():
    logits, (keys, values) = _scanned(CFG)
    want_logits, want_keys, want_values = jax.jit(
        functools.partial(_prefill, place(CFG, mesh_for("1,1,1,1"), policy=F32))
    )(_weights(), TOKENS)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
    for i, local in enumerate(CFG.local_layers):
        np.testing.assert_allclose(keys[i], want_keys[i], rtol=1e-5, atol=1e-6, err_msg=f"layer {i} ({local=})")
        np.testing.assert_allclose(values[i], want_values[i], rtol=1e-5, atol=1e-6, err_msg=f"layer {i} ({local=})")
    # and the comparison tells the kinds apart: with every layer global the logits move
    everywhere_global = _scanned(CFG.replace(sliding_window=0, layer_pattern=""))[0]
    assert np.abs(np.asarray(logits) - np.asarray(everywhere_global)).max() > 1e-3


@functools.cache
def _loss_and_grads(remat: str):
    placement = place(CFG, mesh_for("1,1,1,1"), policy=F32.replace(remat=remat))
    batch = _batch(CFG, seq=SEQ)
    (loss, _), grads = jax.jit(jax.value_and_grad(lambda p: loss_sums(placement, p, batch), has_aux=True))(_weights())
    return float(loss), grads


@pytest.mark.parametrize("remat", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_policies_give_the_loss_and_gradients_of_none_on_a_local_global_pattern(remat):
    want_loss, want_grads = _loss_and_grads("none")
    loss, grads = _loss_and_grads(remat)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    # Gradients of the loss summed over tokens (up to about 10 here): float rounding of a recomputation is
    # about 3e-7 of a weight's largest gradient.
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        atol = 1e-6 * np.abs(w).max()
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol, err_msg=jax.tree_util.keystr(path))
