"""The train and eval steps tell RingAttention the order their batches' tokens lie in (zigzag, as
`put_batch` with `sequence_permutation` lays them out), so the fused per-chunk kernels may run; without a
split sequence there is no order to tell."""

import jax
import jax.numpy as jnp

from meshlm import sharding
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.train import step as train_step
from meshlm.train.evaluate import make_eval_step
from tests.support.hf import mesh_of

F32 = RunPolicy(dtype="float32")


def test_ring_order_follows_the_split():
    cfg = resolve_model("test")
    assert train_step.ring_order(place(cfg, mesh_of("1,1,1,4"), policy=F32)) == "zigzag"
    assert train_step.ring_order(place(cfg, mesh_of("2,2,2,1"), policy=F32)) is None


def test_the_model_sees_the_order_while_tracing(monkeypatch):
    """The ring spec the attention layer reads carries the order set around the traced loss."""
    seen = []
    real = sharding.ring_spec

    def spy():
        spec = real()
        seen.append(None if spec is None else spec.order)
        return spec

    monkeypatch.setattr(sharding, "ring_spec", spy)
    cfg = resolve_model("test").replace(n_layers=1)
    placement = place(cfg, mesh_of("1,1,1,4"), policy=F32)
    params = placement.abstract
    batch = train_step.abstract_batch(placement, 2, 32)
    step = make_eval_step(placement)
    zero = jax.ShapeDtypeStruct((), jnp.float32)
    step.trace(params, batch, (zero, zero))
    assert seen and set(seen) == {"zigzag"}
