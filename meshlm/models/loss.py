"""The token loss: cross-entropy against integer targets, summed over counted tokens, in float32.

    total, count = token_loss_sums(logits, targets, loss_mask)        # from logits already computed
    total, count = head_loss_sums(x, weights, targets, loss_mask, chunk=1024)  # from the final stream

`head_loss_sums` never holds float32 logits of the whole batch. The output projection (compute-dtype
operands, float32 logits, compute-dtype matmuls for the gradients) runs one chunk of sequence positions
at a time inside a `lax.scan`, and only one chunk's [B, chunk, V] logits are alive at once. Under
differentiation each chunk's gradients are computed with its logits, in the same pass (see
`_chunked_fwd`), so the logits are computed once per step and never kept.
Chunk i holds positions i, i + n, i + 2n, ... of every row (n chunks), so a chunk keeps the layout of
the whole (batch over the data axes, length over sp, vocab over tp) and every device works on each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from meshlm import axes, sharding
from meshlm.backends import traced_profile
from meshlm.ops.linear import linear


def cross_entropy(logits: jax.Array, targets: jax.Array, *, one_hot: bool = False) -> jax.Array:
    """Per-token negative log-likelihood [...] of float32 logits [..., V] against integer targets [...].

    `one_hot` picks the target's logit by a product with its one-hot vector instead of a gather: inside
    the pipeline's shard_map XLA cannot partition a gather over a vocabulary split across tp while the
    rows are split across the data axes; the product partitions like any elementwise op."""
    if one_hot:
        picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
        return jax.nn.logsumexp(logits, axis=-1) - picked
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def token_loss_sums(
    logits: jax.Array, targets: jax.Array, loss_mask: jax.Array, *, one_hot: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(sum of the token losses whose `loss_mask` is 1, number of such tokens), float32.

    logits [B, T, V] float32, targets [B, T] int, loss_mask [B, T] (0 or 1, any dtype)."""
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(cross_entropy(logits, targets, one_hot=one_hot) * mask), jnp.sum(mask)


def project(x: jax.Array, weights: jax.Array) -> jax.Array:
    """x [B, T, E] @ weights [E, V]: float32 logits [B, T, V], the vocabulary laid out as the strategy says.

    The matmul takes its operands in x's dtype (the compute dtype) and gives the float32 it accumulates
    in, so no compute-dtype copy of the logits is made. In the backward pass the logits' cotangent is
    cast to the compute dtype and both matmuls run in it; the weights' gradient comes back in float32
    and in the weights' own dtype (`meshlm.ops.linear`). In float32 this is plain autodiff of one matmul.

    Below float32, where the backend's profile asks for it (XLA:CPU), the weights' gradient leaves its
    matmul as it is (`_fence_gradient`)."""
    if x.dtype != jnp.float32 and traced_profile().fence_head_gradient:
        weights = _fence_gradient(weights)
    return sharding.constrain(linear("bte,ev->btv", x, weights, out=jnp.float32), axes.LOGITS)


# Tied embeddings make the head's weights the table transposed, so the weights' gradient is transposed
# on its way to the table. XLA folds that transpose into the gradient's matmul, which then contracts
# both operands on their leading dimension: a form XLA:CPU's fast matmuls (YNNPACK) do not take, and its
# generic one has no bfloat16 x bfloat16 = float32 kernel ("Unsupported element type for
# DotThunk::Execute"). An optimization barrier on the gradient keeps the matmul in the form it was
# written in; the transpose becomes a copy of its result. The forward pass and the value are unchanged.
@jax.custom_vjp
def _fence_gradient(w):
    return w


def _fence_fwd(w):
    return w, None


def _fence_bwd(_, g):
    return (jax.lax.optimization_barrier(g),)


_fence_gradient.defvjp(_fence_fwd, _fence_bwd)


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
    """cap · tanh(logits / cap) (Gemma 2's final-logit soft-capping); the logits themselves for cap 0."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def num_chunks(length: int, chunk: int) -> int:
    """How many chunks of at most `chunk` positions cover `length` (1: all at once; chunk 0 means that)."""
    return 1 if chunk <= 0 or chunk >= length else -(-length // chunk)


def head_loss_sums(
    x: jax.Array,
    weights: jax.Array,
    targets: jax.Array,
    loss_mask: jax.Array,
    *,
    chunk: int,
    one_hot: bool = False,
    softcap: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """`token_loss_sums(project(x, weights), targets, loss_mask)` computed `chunk` positions at a time.

    x [B, T, E] the normed final stream in the compute dtype, weights [E, V] the output projection
    (any float dtype; cast to x's), targets and loss_mask [B, T]. `chunk` 0, or not below T: one piece,
    no scan. Otherwise n = ceil(T / chunk) chunks of ceil(T / n) positions; when n does not divide T
    the rows are padded with uncounted positions. `softcap`: the logits soft-capped first (`soft_cap`)."""
    B, T, E = x.shape
    n = num_chunks(T, chunk)
    if n == 1:
        return token_loss_sums(soft_cap(project(x, weights), softcap), targets, loss_mask, one_hot=one_hot)
    mask = loss_mask.astype(jnp.float32)
    L = -(-T // n)
    if pad := n * L - T:  # padded positions: zero activations, target 0, not counted
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
        targets, mask = (jnp.pad(a, ((0, 0), (0, pad))) for a in (targets, mask))
    # [B, L·n, ...] -> [n, B, L, ...]: chunk i is positions i, i + n, ... (see the module docstring).
    xs = sharding.constrain(x.reshape(B, L, n, E).transpose(2, 0, 1, 3), (None, *axes.STREAM))
    ts, ms = (sharding.constrain(a.reshape(B, L, n).transpose(2, 0, 1), (None, *axes.TOKENS)) for a in (targets, mask))
    # The weights are gathered once, before the loop, in the compute dtype (their embed dimension whole,
    # the vocabulary split as the logits are).
    w = sharding.constrain(weights.astype(x.dtype), axes.HEAD)
    return _chunked_nll(one_hot, jnp.dtype(w.dtype), float(softcap), xs, w, ts, ms), jnp.sum(mask)


# The chunked loss has its own derivative. The loss is one scalar, so its gradient with respect to the
# logits is known in the forward pass: softmax minus the target's one-hot, times the token's mask. The
# differentiated forward pass (`_chunked_fwd`) computes each chunk's logits once and, with them, the
# chunk's x gradient and its share of the weights' gradient; the backward pass only scales them by the
# loss's cotangent. Autodiff of a checkpointed scan would run the head's forward matmul twice (once for
# the value, once more to recompute the logits in the backward): at llama3-8b's vocabulary that second
# pass was 4% of a whole step on an H200. Without differentiation (`_chunked_value`) no gradient is made.


def _chunk_logits(xc, w, cap):
    """A chunk's activations, laid out as the strategy says, and its float32 logits [B, L, V] (soft-capped)."""
    xc = sharding.constrain(xc, axes.STREAM)
    return xc, soft_cap(project(xc, w), cap)


def _chunked_value(one_hot, w_dtype, cap, xs, w, ts, ms):
    def one_chunk(total, chunk_in):
        xc, tc, mc = chunk_in
        nll = cross_entropy(_chunk_logits(xc, w, cap)[1], tc, one_hot=one_hot)
        return total + jnp.sum(nll * mc), None

    return jax.lax.scan(one_chunk, jnp.zeros((), jnp.float32), (xs, ts, ms))[0]


_chunked_nll = jax.custom_vjp(_chunked_value, nondiff_argnums=(0, 1, 2))


def _chunked_fwd(one_hot, w_dtype, cap, xs, w, ts, ms):
    def one_chunk(carry, chunk_in):
        total, dw = carry
        xc, tc, mc = chunk_in
        xc, logits = _chunk_logits(xc, w, cap)
        nll = cross_entropy(logits, tc, one_hot=one_hot)
        # d(sum of nll * mask) / d logits (through the soft cap: 1 - tanh²), in the compute dtype.
        target = jax.nn.one_hot(tc, logits.shape[-1], dtype=jnp.float32)
        g = (jax.nn.softmax(logits, axis=-1) - target) * mc[..., None]
        if cap:
            g = g * (1.0 - jnp.square(logits / cap))
        g = g.astype(xc.dtype)
        g = sharding.constrain(g, axes.LOGITS)
        dx = jnp.einsum("btv,ev->bte", g, w)
        dw = dw + jnp.einsum("bte,btv->ev", xc, g, preferred_element_type=jnp.float32)
        return (total + jnp.sum(nll * mc), sharding.constrain(dw, axes.HEAD)), sharding.constrain(dx, axes.STREAM)

    dw0 = sharding.constrain(jnp.zeros(w.shape, jnp.float32), axes.HEAD)
    (total, dw), dxs = jax.lax.scan(one_chunk, (jnp.zeros((), jnp.float32), dw0), (xs, ts, ms))
    return total, (dxs, dw)


def _chunked_bwd(one_hot, w_dtype, cap, saved, ct):
    dxs, dw = saved
    return (dxs * ct.astype(dxs.dtype)), (dw * ct).astype(w_dtype), None, None


_chunked_nll.defvjp(_chunked_fwd, _chunked_bwd)


__all__ = ["cross_entropy", "token_loss_sums", "project", "soft_cap", "num_chunks", "head_loss_sums"]
