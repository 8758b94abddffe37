"""Parameter, gradient and optimizer-state bytes per device: the planner's arithmetic against real arrays.

The train state is created for real on each mesh (every device holds only its shards), the
gradients are computed for real by a jitted `jax.grad` laid out as the train step lays them out
(reduced onto their parameter's sharding, where the optimizer update consumes them), and the bytes
device 0 holds are compared with `meshlm.plan.state_bytes`, exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import sharding
from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.optimizer import OptimizerConfig, make_optimizer
from meshlm.plan.state_bytes import real_bytes_per_device, state_bytes
from meshlm.train.state import create_train_state
from meshlm.train.step import BATCH_KEYS, loss_sums

CFG = resolve_model("test", {"n_kv_heads": "4"})
MESHES = ["1,8,1,1", "2,2,2,1", "1,2,2,2"]


def _batch(placement, rows=8, seq=32):
    rng = np.random.default_rng(0)
    host = {k: rng.integers(0, 16, (rows, seq)).astype(np.int32) for k in BATCH_KEYS}
    host["positions"] = np.tile(np.arange(seq, dtype=np.int32), (rows, 1))
    host["segment_ids"] = np.ones((rows, seq), np.int32)
    host["loss_mask"] = np.ones((rows, seq), np.float32)
    rows_sharding = sharding.batch_sharding(placement.mesh, placement.strategy)
    return {k: jax.device_put(v, rows_sharding) for k, v in host.items()}


@pytest.fixture(scope="module", params=MESHES)
def real(request):
    shape = parse_mesh_dim(request.param, 8)
    placement = place(CFG, build_mesh(shape, jax.devices()[:8]), policy=RunPolicy(dtype="float32"))
    optimizer = make_optimizer(OptimizerConfig())
    state = create_train_state(placement, optimizer, seed=0)
    grad = jax.grad(lambda p, b: loss_sums(placement, p, b)[0])
    grads = jax.jit(grad, out_shardings=placement.shardings)(state.params, _batch(placement))
    return shape, state, grads


def test_parameter_bytes_exact(real):
    shape, state, _ = real
    assert state_bytes(CFG).params_bytes(shape) == real_bytes_per_device(state.params)


def test_optimizer_state_bytes_exact(real):
    shape, state, _ = real
    assert state_bytes(CFG).optimizer_bytes(shape) == real_bytes_per_device(state.opt_state)


def test_gradient_bytes_exact(real):
    shape, _, grads = real
    assert jnp.isfinite(sum(jnp.sum(g) for g in jax.tree.leaves(grads)))
    assert state_bytes(CFG).grads_bytes(shape) == real_bytes_per_device(grads)


def test_sharding_divides_the_state():
    """The arithmetic is not trivially equal: fsdp over 8 devices holds far less than one device."""
    one, eight = parse_mesh_dim("1,1,1,1", 1), parse_mesh_dim("1,8,1,1", 8)
    sb = state_bytes(CFG)
    assert sb.params_bytes(eight) < sb.params_bytes(one) / 6
    assert sb.optimizer_bytes(one) >= 2 * sb.params_bytes(one)
