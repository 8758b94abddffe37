"""LoRA adapters: shapes and layouts from the weights' logical axes, and the merge equal to PEFT's forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.models.lora import LoraSpec, merged_weight, place_lora
from meshlm.models.placement import place
from meshlm.strategy import PRESETS
from meshlm.strategy.rules import flatten
from tests.support.training import CFG, POLICY, mesh_for


def test_adapters_take_their_weights_layout_and_keep_the_rank_whole():
    placement = place(CFG, mesh_for("1,2,2,2"), policy=POLICY)
    lora = place_lora(placement, LoraSpec(rank=4))
    attn = lora.specs["layers"]["attn"]
    assert attn["wq"] == {"a": P(None, ("fsdp", "sp"), None), "b": P(None, None, "tp", None)}
    assert attn["wo"] == {"a": P(None, "tp", None, None), "b": P(None, None, ("fsdp", "sp"))}
    E, H, D, L = CFG.d_model, CFG.n_heads, CFG.head_dim, CFG.n_layers
    assert lora.shapes["layers"]["attn"]["wo"]["a"].shape == (L, H, D, 4)
    assert lora.shapes["layers"]["attn"]["wo"]["b"].shape == (L, 4, E)
    assert set(lora.targets) == {f"layers/attn/w{x}" for x in "qkvo"} | {
        f"layers/mlp/{x}" for x in ("gate", "up", "down")
    }
    for name, strategy in PRESETS.items():
        assert strategy.params["lora_rank"] is None and strategy.activations["lora_rank"] is None, name


@pytest.mark.parametrize("w_shape, in_axes", [((6, 4, 3), 1), ((4, 3, 6), 2), ((6, 5), 1)])
def test_merge_is_the_low_rank_update_of_the_flattened_projection(w_shape, in_axes):
    """x @ merged == x @ W + scale·(x @ A) @ B with the input and output axes flattened, as a Linear layer
    with PEFT's LoRA computes it."""
    rng = np.random.default_rng(0)
    r, scale = 2, 1.5
    w = rng.normal(size=w_shape).astype(np.float32)
    a = rng.normal(size=(*w_shape[:in_axes], r)).astype(np.float32)
    b = rng.normal(size=(r, *w_shape[in_axes:])).astype(np.float32)
    x = rng.normal(size=(3, int(np.prod(w_shape[:in_axes])))).astype(np.float32)
    n_in = x.shape[1]
    merged = np.asarray(merged_weight(jnp.asarray(w), jnp.asarray(a), jnp.asarray(b), scale)).reshape(n_in, -1)
    want = x @ w.reshape(n_in, -1) + scale * (x @ a.reshape(n_in, r)) @ b.reshape(r, -1)
    np.testing.assert_allclose(x @ merged, want, rtol=1e-5, atol=1e-5)


def test_init_is_the_base_model_and_the_same_on_every_mesh():
    one = place_lora(place(CFG, mesh_for("1,1,1,1"), policy=POLICY), LoraSpec(rank=4)).init(0)
    eight = place_lora(place(CFG, mesh_for("1,2,2,2"), policy=POLICY), LoraSpec(rank=4)).init(0)
    for (path, x), y in zip(flatten(jax.device_get(one)).items(), flatten(jax.device_get(eight)).values()):
        np.testing.assert_array_equal(x, y, err_msg=path)
        assert (np.abs(x).max() > 0) == path.endswith("/a"), path  # A random, B zero


def test_merged_weight_on_the_host_matches_the_traced_one():
    """The one merge: numpy arrays (an export, one layer at a time) merge on the host as the export always
    did (float32 tensordot), jax arrays (training, serving) by the batched einsum, to float32 rounding."""
    rng = np.random.default_rng(0)
    w, a, b = (rng.normal(size=s).astype(np.float32) for s in ((3, 8, 2, 4), (3, 8, 4), (3, 4, 2, 4)))
    host = merged_weight(w[1], a[1], b[1], 0.5)
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    np.testing.assert_array_equal(host, w[1] + 0.5 * np.tensordot(a[1], b[1], axes=([-1], [0])))
    traced = np.asarray(jax.jit(merged_weight, static_argnums=3)(w, a, b, 0.5))
    np.testing.assert_allclose(traced[1], host, rtol=1e-6, atol=1e-6)
