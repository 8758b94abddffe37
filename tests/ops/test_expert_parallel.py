"""Expert parallelism on 8 simulated devices: outputs, gradients and aux equal one-device `moe_mlp`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from meshlm.ops.expert_parallel import moe_mlp_ep
from meshlm.ops.moe import moe_mlp
from tests.ops.test_moe import make_weights

N, E, X = 32, 8, 8
AUX = ("load", "dropped_fraction", "load_balancing_loss", "z_loss")


@functools.cache
def make_mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def objective(fn, args, dy, mask):
    """(y, aux, grads of sum(y * dy) + the weighted aux losses for all five arguments)."""

    def loss(*a):
        y, aux = fn(*a, mask=mask)
        return jnp.sum(y * dy) + 0.1 * aux["load_balancing_loss"] + 0.01 * aux["z_loss"], (y, aux)

    grads, (y, aux) = jax.grad(loss, argnums=tuple(range(5)), has_aux=True)(*args)
    return y, aux, grads


@functools.cache
def compiled(mesh_shape, names, k, capacity_factor):
    kw = dict(k=k, renormalize=True, capacity_factor=capacity_factor)
    ep = functools.partial(moe_mlp_ep, mesh=make_mesh(mesh_shape, names), data_axes=names[:-1], **kw)
    one = functools.partial(moe_mlp, **kw)
    return tuple(jax.jit(functools.partial(objective, fn)) for fn in (ep, one))


def check_equal(mesh_shape, names, *, k=2, capacity_factor=None, seed=0, bias_expert=False):
    args = make_weights(X, seed=seed, n=N, e=E)
    if bias_expert:
        args[1] = args[1].at[:, 3].add(1.0)  # expert 3 overflows its capacity
    dy = jax.random.normal(jax.random.key(seed + 1), (N, E))
    mask = (np.arange(N) % 7 != 6).astype(np.float32)
    ep_fn, one_fn = compiled(mesh_shape, names, k, capacity_factor)
    got, want = ep_fn(args, dy, mask), one_fn(args, dy, mask)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    for name in AUX:
        np.testing.assert_allclose(np.asarray(got[1][name]), np.asarray(want[1][name]), rtol=1e-5, atol=1e-7)
    for g, w in zip(got[2], want[2], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    return want[1]


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_equals_one_device(ep):
    aux = check_equal((ep,), ("ep",))
    assert float(aux["dropped_fraction"]) == 0.0


def test_expert_parallel_with_a_data_axis():
    check_equal((4, 2), ("dp", "ep"), k=1, seed=3)


def test_capacity_is_global_over_token_shards():
    aux = check_equal((2, 4), ("dp", "ep"), capacity_factor=1.0, seed=5, bias_expert=True)
    assert float(aux["dropped_fraction"]) > 0.0


def test_experts_must_divide_over_ep():
    args = make_weights(6, n=N, e=E)
    with pytest.raises(ValueError, match="divide by ep=4"):
        moe_mlp_ep(*args, mesh=make_mesh((4,), ("ep",)), k=2, renormalize=True)
