"""`--model.scan_unroll`: the layer loop unrolled gives the scanned loop's loss and gradients and keeps
its remat policy's memory; auto (0) unrolls on GPU only; bad values are refused in one line."""

import jax
import numpy as np
import pytest

from meshlm.errors import UsageError
from meshlm.models import decoder
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.train.step import loss_sums
from tests.models.test_loss import _batch
from tests.support.training import mesh_for

F32 = RunPolicy(dtype="float32")


def _loss_and_grads(cfg, policy, params, batch):
    placement = place(cfg, mesh_for("1,1,1,1"), policy=policy)
    return jax.jit(jax.value_and_grad(lambda p: loss_sums(placement, p, batch), has_aux=True))(params)


def test_unrolled_layers_equal_the_scanned_loop():
    cfg, scanned = resolve_model("test", {"n_layers": "3"}), F32.replace(scan_unroll=1)
    batch = _batch(cfg)
    params = place(cfg, mesh_for("1,1,1,1"), policy=scanned).init(0)
    ((want, _), want_grads) = _loss_and_grads(cfg, scanned, params, batch)
    for unroll in (2, 3):  # two per iteration (3 layers: one iteration of two, one of one) and all
        ((got, _), grads) = _loss_and_grads(cfg, scanned.replace(scan_unroll=unroll), params, batch)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _step_memory(cfg, policy, batch, params) -> int:
    placement = place(cfg, mesh_for("1,1,1,1"), policy=policy)
    grads = jax.jit(jax.grad(lambda p: loss_sums(placement, p, batch)[0]))
    memory = grads.lower(params).compile().memory_analysis()
    return memory.temp_size_in_bytes


def test_unrolled_layers_keep_the_remat_policy():
    # Unrolled, a checkpointed layer's recomputation must not be merged with its forward pass: `full`
    # then keeps only each layer's input, far less than `none`'s activations (as it does scanned).
    cfg = resolve_model("test", {"n_layers": "4", "d_model": "128", "mlp_dim": "512"})
    unrolled = F32.replace(scan_unroll=4)
    batch = _batch(cfg, seq=128)
    params = place(cfg, mesh_for("1,1,1,1"), policy=unrolled).init(0)
    none, full = (_step_memory(cfg, unrolled.replace(remat=r), batch, params) for r in ("none", "full"))
    assert full < 0.7 * none, (full, none)


def test_auto_unrolls_on_gpu_only(monkeypatch):
    policy = RunPolicy()
    assert policy.scan_unroll == 0
    assert decoder.scan_unroll(policy, 4) == 1  # these tests run on CPU devices
    monkeypatch.setattr(decoder.sharding, "active_platform", lambda: "gpu")
    assert decoder.scan_unroll(policy, 4) == 4
    assert decoder.scan_unroll(policy.replace(scan_unroll=2), 4) == 2
    assert decoder.scan_unroll(policy.replace(scan_unroll=9), 4) == 4


@pytest.mark.parametrize("field, value", [("scan_unroll", "-1"), ("max_documents", "0")])
def test_bad_values_are_refused(field, value):
    with pytest.raises(UsageError, match=f"{field}={value}"):
        RunPolicy(**{field: int(value)})
