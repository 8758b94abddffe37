"""The train state (step, params, optimizer state) and its sharding on the mesh."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from meshlm import sharding
from meshlm.models.placement import Placement


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken so far
    params: Any
    opt_state: Any


def state_shardings(placement: Placement, optimizer: optax.GradientTransformation) -> TrainState:
    """Optimizer moments take their parameter's optimizer-state layout (the parameter's own, or sharded
    further by a ZeRO stage); counters replicate."""
    replicated = sharding.replicated(placement.mesh)
    opt_shape = jax.eval_shape(optimizer.init, placement.shapes)
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, placement.opt_shardings, transform_non_params=lambda _: replicated
    )
    return TrainState(step=replicated, params=placement.shardings, opt_state=opt_shardings)


def abstract_state(placement: Placement, optimizer: optax.GradientTransformation) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target and the input of ahead-of-time compiles."""
    shapes = jax.eval_shape(lambda p: TrainState(jax.numpy.zeros((), "int32"), p, optimizer.init(p)), placement.shapes)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_shardings(placement, optimizer)
    )


def create_train_state(placement: Placement, optimizer: optax.GradientTransformation, seed: int = 0) -> TrainState:
    """Fresh parameters and optimizer state, each device creating only its own shards."""

    def init():
        params = placement.random_params(seed)
        return TrainState(jax.numpy.zeros((), "int32"), params, optimizer.init(params))

    return jax.jit(init, out_shardings=state_shardings(placement, optimizer))()


def train_state_from_params(placement: Placement, optimizer: optax.GradientTransformation, params: Any) -> TrainState:
    """A fresh optimizer around given (already sharded) parameters, e.g. Hugging Face weights to fine-tune."""
    init = lambda p: TrainState(jax.numpy.zeros((), "int32"), p, optimizer.init(p))  # noqa: E731
    return jax.jit(init, out_shardings=state_shardings(placement, optimizer), donate_argnums=0)(params)
