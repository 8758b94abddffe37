"""The train state (step, params, optimizer state) and its sharding on the mesh.

With LoRA (`lora`, a `meshlm.models.lora.LoraPlacement`) the params are {"base": frozen weights (in the
base dtype), "lora": adapters} and the optimizer state is the adapters' only."""

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


def state_shardings(placement: Placement, optimizer: optax.GradientTransformation, lora=None) -> TrainState:
    """Optimizer moments take their parameter's optimizer-state layout (the parameter's own, or sharded
    further by a ZeRO stage); counters replicate."""
    replicated = sharding.replicated(placement.mesh)
    trained = lora if lora is not None else placement
    opt_shape = jax.eval_shape(optimizer.init, trained.shapes)
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, trained.opt_shardings, transform_non_params=lambda _: replicated
    )
    params = {"base": placement.shardings, "lora": lora.shardings} if lora is not None else placement.shardings
    return TrainState(step=replicated, params=params, opt_state=opt_shardings)


def abstract_state(placement: Placement, optimizer: optax.GradientTransformation, lora=None) -> TrainState:
    """ShapeDtypeStructs with shardings: the restore target and the input of ahead-of-time compiles."""
    if lora is None:
        shapes = jax.eval_shape(lambda p: TrainState(jax.numpy.zeros((), "int32"), p, optimizer.init(p)), placement.shapes)
    else:
        shapes = jax.eval_shape(lambda b, a: TrainState(jax.numpy.zeros((), "int32"), {"base": b, "lora": a},
                                                        optimizer.init(a)), lora.base_shapes, lora.shapes)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
        state_shardings(placement, optimizer, lora)
    )


def create_train_state(placement: Placement, optimizer: optax.GradientTransformation, seed: int = 0,
                       lora=None) -> TrainState:
    """Fresh parameters and optimizer state, each device creating only its own shards. With `lora`, a
    random base (from `seed`) and fresh adapters."""

    def init():
        params = placement.random_params(seed)
        if lora is not None:
            adapters = lora.random(seed)
            return TrainState(jax.numpy.zeros((), "int32"), {"base": lora.cast_base(params), "lora": adapters},
                              optimizer.init(adapters))
        return TrainState(jax.numpy.zeros((), "int32"), params, optimizer.init(params))

    return jax.jit(init, out_shardings=state_shardings(placement, optimizer, lora))()


def train_state_from_params(placement: Placement, optimizer: optax.GradientTransformation, params: Any,
                            lora=None, seed: int = 0) -> TrainState:
    """A fresh optimizer around given (already sharded) parameters, e.g. Hugging Face weights to fine-tune;
    with `lora` they become the frozen base (cast to its dtype) under fresh adapters (from `seed`)."""
    def init(p):
        if lora is None:
            return TrainState(jax.numpy.zeros((), "int32"), p, optimizer.init(p))
        adapters = lora.random(seed)
        return TrainState(jax.numpy.zeros((), "int32"), {"base": lora.cast_base(p), "lora": adapters},
                          optimizer.init(adapters))

    return jax.jit(init, out_shardings=state_shardings(placement, optimizer, lora), donate_argnums=0)(params)


def checkpointed(state: TrainState, lora=None) -> TrainState:
    """What a checkpoint holds: the whole state, or with LoRA all of it but the frozen base."""
    return state if lora is None else state._replace(params={"lora": state.params["lora"]})


def earlier_layouts(target: TrainState) -> tuple:
    """(abstract state, convert) for each older layout a checkpoint of `target` may hold: AdamW's state
    without the clip's empty state in front (what `--clip_norm=0` saved when it left the clip out)."""
    from meshlm.optimizer import from_unclipped

    unclipped = target._replace(opt_state=target.opt_state[1])
    return ((unclipped, lambda state: state._replace(opt_state=from_unclipped(state.opt_state))),)


def with_base(state: TrainState, base: Any) -> TrainState:
    """A restored LoRA checkpoint's state with its frozen base put back."""
    return state._replace(params={"base": base, "lora": state.params["lora"]})


def lora_for(cfg, placement: Placement):
    """The run's `LoraPlacement` (`--lora_rank` > 0), or None: its targets found and laid out now, before
    any data or compile work (a bad --lora_targets is one line)."""
    if not getattr(cfg, "lora_rank", 0):
        return None
    from meshlm.models.lora import LoraSpec, place_lora

    spec = LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_base_dtype)
    return place_lora(placement, spec)


def lora_meta(lora, init_source, seed: int) -> dict:
    """What a LoRA checkpoint records of its adapters and of the base they sit on (its folder, or the seed
    of a random base)."""
    return {**lora.spec.meta(), "base": str(init_source) if init_source is not None else None, "base_seed": seed}


def frozen_base(placement: Placement, lora, init_source, seed: int) -> Any:
    """The base weights a LoRA run trains on, in the base dtype: `--init_from`'s, or random from `seed`."""
    if init_source is not None:
        from meshlm.checkpoint.weights import load_params

        params = load_params(init_source, placement)
    else:
        params = placement.init(seed)
    return jax.jit(lora.cast_base, out_shardings=placement.shardings, donate_argnums=0)(params)


def eval_params(params: Any, lora=None) -> Any:
    """The weights to evaluate or serve: the params, or with LoRA the base with its adapters merged in."""
    if lora is None:
        return params
    return jax.jit(lora.merge, out_shardings=lora.base.shardings)(params["base"], params["lora"])
