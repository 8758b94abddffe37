"""Weight projections in the compute dtype, with an explicit backward.

    y = linear("bte,ehd->bthd", x, w)                      # x @ w in x's dtype
    logits = linear("bte,ev->btv", x, w, out=jnp.float32)  # the same operands, float32 out

`w` is a stored weight (any float dtype: float32 master weights, or bfloat16 ones); the matmul casts it
to x's dtype, the compute dtype. The gradient is autodiff's, written out as two matmuls:

- x's gradient: the output's cotangent (cast to the compute dtype) times w, in the compute dtype;
- w's gradient: x times that cotangent, in the output's dtype (the compute dtype, or `out`: the output
  head's is float32, as its logits are; float32 on XLA:CPU, see CPU_FLOAT32_WEIGHT_GRADIENTS), then
  in w's own dtype.

Why write it out: XLA:CPU laid autodiff's weight-gradient matmuls of the MLP out with both operands
transposed, a form YNNPACK does not take, and ran them as Eigen's generic bfloat16 matmul, several
times slower than the rest (one device, the bench shape: the whole step took twice as long). Written
as one einsum of x and the cotangent, every matmul of the step is a YNNPACK fusion. The backward also
reuses the weight as the forward cast it, so a sharded weight is gathered once for both matmuls.

The einsum `spec` has two operands, no repeated index within one operand and no index summed away
that the other operand lacks (each index of w is in x or the output), which holds for every projection
of the model. In float32 (x's dtype) this is plain autodiff of one einsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshlm import sharding


# On XLA:CPU w's gradient comes out of its matmul in float32 whatever the output's dtype: YNNPACK
# accumulates in float32 anyway, and the step skips rounding it to bfloat16 and widening it again for
# the float32 weights (1,8,1,1 on the bench shape: 1.037x per step, in one process against the other form). On TPU it stays in the output's
# dtype: XLA:TPU would reduce-scatter float32 gradients over fsdp, twice the bytes.
CPU_FLOAT32_WEIGHT_GRADIENTS = True


def linear(spec: str, x: jax.Array, w: jax.Array, out=None) -> jax.Array:
    """`einsum(spec, x, w)` with w cast to x's dtype, the result (and w's gradient) in `out`, default
    x's dtype (module docstring)."""
    if x.dtype == jnp.float32:
        return _project(spec, out, x, w)
    out = None if out is None else jnp.dtype(out)
    dw_dtype = out or jnp.dtype(x.dtype)
    if CPU_FLOAT32_WEIGHT_GRADIENTS and sharding.active_platform() == "cpu":
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
