"""Weight projections in the compute dtype, with a float32 weight gradient.

    y = linear("bte,ehd->bthd", x, w)                      # x @ w in x's dtype
    logits = linear("bte,ev->btv", x, w, out=jnp.float32)  # the same operands, float32 out

`w` is a stored weight (any float dtype: float32 master weights, or bfloat16 ones); the matmul casts it
to x's dtype, the compute dtype. The gradient is the one of that cast and matmul, computed as the
hardware wants it:

- x's gradient is one matmul of the output's cotangent (cast to the compute dtype) and w, in the
  compute dtype;
- w's gradient is one matmul of x and that cotangent, both in the compute dtype, accumulated and
  returned in float32, then in w's own dtype. Plain autodiff would give it in the compute dtype (the
  cast's transpose widens it afterwards), rounding every step's weight gradient to bfloat16; and on
  XLA:CPU its layout (both operands transposed) is one YNNPACK cannot take, so XLA:CPU runs it as a
  generic Eigen bfloat16 matmul that is several times slower than the rest (one device, the bench
  shape: the whole step took twice as long).

The einsum `spec` has two operands, no repeated index within one operand and no index summed away
that the other operand lacks (each index of w is in x or the output), which holds for every projection
of the model. In float32 (x's dtype) this is plain autodiff of one einsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def linear(spec: str, x: jax.Array, w: jax.Array, out=None) -> jax.Array:
    """`einsum(spec, x, w)` with w cast to x's dtype; the result in `out` (default x's dtype) and a
    float32 weight gradient (module docstring)."""
    if x.dtype == jnp.float32:
        return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=out)
    return _linear(spec, None if out is None else jnp.dtype(out), jnp.dtype(w.dtype), x, w)


def _parts(spec: str) -> tuple[str, str, str]:
    inputs, output = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    return x, w, output


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _linear(spec, out, w_dtype, x, w):
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=out)


def _linear_fwd(spec, out, w_dtype, x, w):
    # The residual is the weight as the matmul used it (cast), so that the backward's matmul uses the
    # same value: sharded, it is gathered once for both (a second cast would be gathered again).
    w = w.astype(x.dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=out), (x, w)


def _linear_bwd(spec, out, w_dtype, saved, g):
    x, w = saved
    xs, ws, ys = _parts(spec)
    g = g.astype(x.dtype)
    dx = jnp.einsum(f"{ys},{ws}->{xs}", g, w)
    dw = jnp.einsum(f"{xs},{ys}->{ws}", x, g, preferred_element_type=jnp.float32)
    return dx, dw.astype(w_dtype)


_linear.defvjp(_linear_fwd, _linear_bwd)

__all__ = ["linear"]
