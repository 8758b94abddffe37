"""One jitted, donated train step: loss, gradients (with optional accumulation), AdamW update.

The loss is the mean token cross-entropy (float32) over tokens whose `loss_mask` is 1. With gradient
accumulation the step sums losses and token counts over micro-batches and divides once, so the update
is exactly the one of a single large batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshlm import sharding
from meshlm.models.pipelined import pipelined_loss_and_grads
from meshlm.models.placement import Placement
from meshlm.ops.pipeline import Schedule
from meshlm.train.state import TrainState, state_shardings

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def loss_sums(placement: Placement, params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses, number of counted tokens) for one (micro-)batch."""
    logits = placement.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(mask)


def _micro_batches(batch: dict, n: int, placement: Placement) -> dict:
    """[B, T] -> [n, B/n, T], micro-batch i = rows i, i+n, ...: each device keeps its own rows local."""
    data_spec = sharding.batch_sharding(placement.mesh, placement.strategy).spec
    stacked = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec(None, *data_spec))

    def split(x):
        return jax.lax.with_sharding_constraint(x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), stacked)

    return {k: split(v) for k, v in batch.items()}


def make_train_step(
    placement: Placement,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule | None = None,
    grad_accum: int = 1,
    pipeline: Schedule | None = None,
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """`step(state, batch) -> (state, metrics)`; the state's buffers are donated (updated in place).

    With `pipeline`, the mesh has a pp axis and the layers run as pipeline stages over microbatches
    (`meshlm.models.pipelined`); the update is the same."""
    grad_fn = jax.value_and_grad(lambda p, b: loss_sums(placement, p, b), has_aux=True)

    def mean_loss_grads(params, batch):
        """(sum of token losses, token count, gradients of the mean loss)."""
        if pipeline is not None:
            (nll, count), grads = pipelined_loss_and_grads(placement, pipeline, params, batch)
            return nll, count, grads
        if grad_accum == 1:
            (nll, count), grads = grad_fn(params, batch)
        else:
            def accumulate(carry, micro):
                (nll, count), grads = grad_fn(params, micro)
                return jax.tree.map(jnp.add, carry, (nll, count, grads)), None

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (nll, count, grads), _ = jax.lax.scan(accumulate, zeros, _micro_batches(batch, grad_accum, placement))
        count = jnp.maximum(count, 1.0)
        return nll, count, jax.tree.map(lambda g: g / count, grads)

    def step(state: TrainState, batch: dict):
        nll, count, grads = mean_loss_grads(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": nll / count, "grad_norm": optax.tree.norm(grads), "tokens": count}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    shardings = state_shardings(placement, optimizer)
    batch_shardings = {k: sharding.batch_sharding(placement.mesh, placement.strategy) for k in BATCH_KEYS}
    return jax.jit(
        step,
        in_shardings=(shardings, batch_shardings),
        out_shardings=(shardings, sharding.replicated(placement.mesh)),
        donate_argnums=0,
    )


def sequence_permutation(placement: Placement, seq_len: int) -> np.ndarray | None:
    """The load-balancing (zigzag) order of the sequence when it is split over a ring, else None."""
    sp = sharding.sequence_parallel_size(placement.mesh, placement.strategy)
    if sp == 1:
        return None
    from meshlm.ops.ring import zigzag_permutation

    return zigzag_permutation(seq_len, sp)


def put_batch(placement: Placement, local_batch: dict, perm: np.ndarray | None = None) -> dict:
    """This process's rows (numpy) -> global arrays laid out on the mesh, in ring order when `perm` is set."""
    target = sharding.batch_sharding(placement.mesh, placement.strategy)
    out = {}
    for key in BATCH_KEYS:
        x = np.asarray(local_batch[key])
        if perm is not None:
            x = x[:, perm]
        out[key] = jax.make_array_from_process_local_data(target, x)
    return out
