"""Weight projections in the compute dtype, with an explicit backward.

    y = linear("bte,ehd->bthd", x, w)                      # x @ w in x's dtype
    logits = linear("bte,ev->btv", x, w, out=jnp.float32)  # the same operands, float32 out

`w` is a stored weight (any float dtype); the matmul casts it to x's dtype, the compute dtype. The
backward is autodiff's, written out as two matmuls: x's gradient in the compute dtype; w's gradient as
one einsum of x and the cotangent, in the output's dtype (or float32 where the backend's profile says
so, `meshlm.backends`), then in w's own dtype. It reuses the weight as the forward cast it, so a sharded
weight is gathered once for both matmuls. Why it is written out (XLA:CPU's matmul forms) is in
docs/kernels.md ("Backend profiles"). `spec` has two operands, no index repeated within one and none
summed away that the other lacks; in float32 this is plain autodiff of one einsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm.backends import traced_profile


def linear(spec: str, x: jax.Array, w: jax.Array, out=None) -> jax.Array:
    """`einsum(spec, x, w)` with w cast to x's dtype, the result (and w's gradient) in `out`, default
    x's dtype (module docstring)."""
    if x.dtype == jnp.float32:
        return _project(spec, out, x, w)
    out = None if out is None else jnp.dtype(out)
    dw_dtype = out or jnp.dtype(x.dtype)
    if traced_profile().float32_weight_gradients:
        dw_dtype = jnp.dtype(jnp.float32)
    return _linear(spec, out, dw_dtype, jnp.dtype(w.dtype), x, w)


def gradient_specs(spec: str) -> tuple[str, str]:
    """The einsums of the backward of `spec` ("x,w->y"): (x's gradient "y,w->x", w's gradient "x,y->w")."""
    inputs, y = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


def _project(spec, out, x, w):
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _linear(spec, out, dw_dtype, w_dtype, x, w):
    return _project(spec, out, x, w)


def _linear_fwd(spec, out, dw_dtype, w_dtype, x, w):
    # The residual is the weight as the matmul used it (cast), so that the backward's matmul uses the
    # same value: sharded, it is gathered once for both (a second cast would be gathered again).
    w = w.astype(x.dtype)
    return _project(spec, out, x, w), (x, w)


def _linear_bwd(spec, out, dw_dtype, w_dtype, saved, g):
    x, w = saved
    dx_spec, dw_spec = gradient_specs(spec)
    g = g.astype(x.dtype)
    dx = jnp.einsum(dx_spec, g, w)
    dw = jnp.einsum(dw_spec, x, g, preferred_element_type=dw_dtype)
    return dx, dw.astype(w_dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)

__all__ = ["linear", "gradient_specs"]
