"""The token loss: cross-entropy of float32 logits against integer targets, summed over counted tokens.

    total, count = token_loss_sums(logits, targets, loss_mask)   # the mean loss is total / count

Every training path (plain, gradient accumulation, ZeRO shards, pipeline stages) computes its loss here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def token_loss_sums(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array, *,
                    one_hot: bool = False) -> tuple[jax.Array, jax.Array]:
    """(sum of the token losses whose `loss_mask` is 1, number of such tokens), float32.

    logits [B, T, V] float32, targets [B, T] int, loss_mask [B, T] (0 or 1, any dtype). `one_hot` picks
    the target's logit by a product with its one-hot vector instead of a gather: inside the pipeline's
    shard_map XLA cannot partition a gather over a vocabulary split across tp while the rows are split
    across the data axes; the product partitions like any elementwise op."""
    if one_hot:
        picked = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axis=-1)
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
    else:
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


__all__ = ["token_loss_sums"]
