"""meshlm.ops.linear: the projections' values and gradients against plain autodiff of the same einsum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import backends
from meshlm.ops import linear as linear_module
from meshlm.ops.linear import linear

# Every projection of the model (meshlm.models.decoder, meshlm.models.loss) with its weight's shape.
B, T, E, H, K, D, M, V = 2, 8, 16, 4, 2, 8, 24, 32
SPECS = {
    "bte,ehd->bthd": ((B, T, E), (E, H, D)),
    "bte,ekd->btkd": ((B, T, E), (E, K, D)),
    "bthd,hde->bte": ((B, T, H, D), (H, D, E)),
    "bte,em->btm": ((B, T, E), (E, M)),
    "btm,me->bte": ((B, T, M), (M, E)),
    "bte,ev->btv": ((B, T, E), (E, V)),
}


def _inputs(x_shape, w_shape, dtype):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
    w = 0.1 * jax.random.normal(kw, w_shape, jnp.float32)
    return x, w, kg


def _plain(spec, x, w, out=None):
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=out)


@pytest.mark.parametrize("spec", SPECS)
def test_float32_is_plain_autodiff(spec):
    x, w, kg = _inputs(*SPECS[spec], jnp.float32)
    y, vjp = jax.vjp(lambda x, w: linear(spec, x, w), x, w)
    y0, vjp0 = jax.vjp(lambda x, w: _plain(spec, x, w), x, w)
    g = jax.random.normal(kg, y.shape, y.dtype)
    np.testing.assert_array_equal(y, y0)
    for a, b in zip(vjp(g), vjp0(g)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("out", [None, jnp.float32])
@pytest.mark.parametrize("cpu_float32", [True, False], ids=["cpu", "gpu_tpu"])
def test_bfloat16_value_and_gradients(spec, out, cpu_float32, monkeypatch):
    """On CPU (these tests) w's gradient leaves its matmul in float32; `cpu_float32=False` is what GPU
    and TPU get: the output's dtype."""
    monkeypatch.setattr(linear_module, "traced_profile", lambda: backends.CPU if cpu_float32 else backends.GPU)
    x, w, kg = _inputs(*SPECS[spec], jnp.bfloat16)
    y, vjp = jax.vjp(lambda x, w: linear(spec, x, w, out=out), x, w)
    y0, vjp0 = jax.vjp(lambda x, w: _plain(spec, x, w, out), x, w)
    assert y.dtype == (jnp.float32 if out else jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))
    g = jax.random.normal(kg, y.shape, jnp.float32).astype(y.dtype)
    (dx, dw), (dx0, dw0) = vjp(g), vjp0(g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == w.dtype == jnp.float32
    # x's gradient: autodiff's matmul in the compute dtype (bfloat16 rounding apart).
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx0, np.float32), rtol=1e-2, atol=1e-2)
    # The weight's gradient is the product of x and the cotangent in the output's dtype: float32
    # products of the bfloat16 operands with `out=float32` (the output head) or on CPU, else rounded
    # to bfloat16.
    xs, rest = spec.split(",")
    ws, ys = rest.split("->")
    exact = jnp.einsum(
        f"{xs},{ys}->{ws}", x.astype(jnp.float32), g.astype(jnp.bfloat16).astype(jnp.float32), precision="highest"
    )
    if out or cpu_float32:
        np.testing.assert_allclose(dw, exact, rtol=1e-5, atol=1e-5)
    else:  # within bfloat16's rounding of the exact product, and bfloat16 values
        rounding = np.abs(exact.astype(jnp.bfloat16).astype(jnp.float32) - exact)
        assert np.all(np.abs(dw - exact) <= 2 * rounding + 1e-6)
        assert np.array_equal(np.asarray(dw), np.asarray(dw.astype(jnp.bfloat16).astype(jnp.float32)))
    # Never further from the exact product than autodiff's own weight gradient.
    assert float(jnp.max(jnp.abs(dw - exact))) <= float(jnp.max(jnp.abs(dw0.astype(jnp.float32) - exact))) + 1e-6


def test_bfloat16_weights_get_bfloat16_gradients():
    x, w, kg = _inputs(*SPECS["bte,em->btm"], jnp.bfloat16)
    w = w.astype(jnp.bfloat16)
    dw = jax.grad(lambda w: jnp.sum(linear("bte,em->btm", x, w).astype(jnp.float32)))(w)
    assert dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(dw, np.float32),
        np.asarray(jnp.sum(x.astype(jnp.float32), (0, 1))[:, None] * jnp.ones((1, M)), np.float32),
        rtol=1e-2,
    )
