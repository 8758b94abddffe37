"""The train state (step, params, optimizer state) and its sharding on the mesh.

Which parameters train is a `meshlm.train.trainable.Trainable` (`trainable`; None: every weight): the
optimizer state is its trained tree's, the params its whole tree (with LoRA {"base", "lora"})."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from meshlm import sharding
from meshlm.models.placement import Placement
from meshlm.optimizer import from_unclipped
from meshlm.train.trainable import Trainable, trained_by


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken so far
    params: Any
    opt_state: Any


def state_shardings(
    placement: Placement, optimizer: optax.GradientTransformation, trainable: Trainable | None = None
) -> TrainState:
    """Optimizer moments take their parameter's optimizer-state layout (the parameter's own, or sharded
    further by a ZeRO stage); counters replicate."""
    trainable = trained_by(placement, trainable)
    replicated = sharding.replicated(placement.mesh)
    opt_shape = jax.eval_shape(optimizer.init, trainable.shapes)
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, trainable.opt_shardings, transform_non_params=lambda _: replicated
    )
    return TrainState(step=replicated, params=trainable.param_shardings(), opt_state=opt_shardings)


def _state_around(trainable: Trainable, optimizer: optax.GradientTransformation, params: Any) -> TrainState:
    """Traceable: step 0 and fresh optimizer state for the trained part of the state's `params`."""
    return TrainState(jax.numpy.zeros((), "int32"), params, optimizer.init(trainable.split(params)[0]))


def abstract_state(
    placement: Placement, optimizer: optax.GradientTransformation, trainable: Trainable | None = None
) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target and the input of ahead-of-time compiles."""
    trainable = trained_by(placement, trainable)
    shapes = jax.eval_shape(lambda p: _state_around(trainable, optimizer, p), trainable.abstract_params())
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        state_shardings(placement, optimizer, trainable),
    )


def create_train_state(
    placement: Placement, optimizer: optax.GradientTransformation, seed: int = 0, trainable: Trainable | None = None
) -> TrainState:
    """Fresh parameters and optimizer state, each device creating only its own shards (from `seed`)."""
    trainable = trained_by(placement, trainable)

    def init():
        return _state_around(trainable, optimizer, trainable.initial(placement.random_params(seed), seed))

    return jax.jit(init, out_shardings=state_shardings(placement, optimizer, trainable))()


def train_state_from_params(
    placement: Placement,
    optimizer: optax.GradientTransformation,
    params: Any,
    trainable: Trainable | None = None,
    seed: int = 0,
) -> TrainState:
    """A fresh optimizer around given (already sharded) parameters, e.g. Hugging Face weights to fine-tune
    (with LoRA: the frozen base under fresh adapters from `seed`)."""
    trainable = trained_by(placement, trainable)

    def init(p):
        return _state_around(trainable, optimizer, trainable.initial(p, seed))

    return jax.jit(init, out_shardings=state_shardings(placement, optimizer, trainable), donate_argnums=0)(params)


def checkpointed(state: TrainState, trainable: Trainable) -> TrainState:
    """What a checkpoint holds: the state with the params `trainable` saves."""
    return state._replace(params=trainable.saved(state.params))


def earlier_layouts(target: TrainState) -> tuple:
    """(abstract state, convert) for each older layout a checkpoint of `target` may hold: AdamW's state
    without the clip's empty state in front (what `--clip_norm=0` saved when it left the clip out)."""
    unclipped = target._replace(opt_state=target.opt_state[1])
    return ((unclipped, lambda state: state._replace(opt_state=from_unclipped(state.opt_state))),)
