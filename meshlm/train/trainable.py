"""Which parameters a run trains: one interface for state, step and checkpoint.

`Trainable` trains every weight; `LoraTraining` trains low-rank adapters over a frozen base
(docs/lora.md). Both say which tree gets gradients and optimizer state, how the state's params split
into (trained, frozen) and join back, what a checkpoint holds and how the frozen part comes back on
restore, and which weights evaluation sees. `trainable_for(cfg, placement)` picks the run's.
"""

from __future__ import annotations

from typing import Any

import jax

from meshlm import sharding
from meshlm.checkpoint.weights import load_params
from meshlm.models.lora import LoraPlacement, LoraSpec, place_lora
from meshlm.models.placement import Placement


def model_loss_sums(placement: Placement, params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses, number of counted tokens) for one (micro-)batch. The model runs as
    `Placement.apply` runs it, but the head and the loss run as one (`Decoder.head_loss`): the logits are
    computed `policy.loss_chunk` positions at a time and never held for the whole batch."""
    x = placement.stream(params, batch["inputs"], batch["positions"], batch["segment_ids"])
    with sharding.activate(placement.mesh, placement.strategy):
        return placement.structure.head_loss(x, batch["targets"], batch["loss_mask"], params)


class Trainable:
    """Every weight trains: the state's params are the model's, all of them get gradients and moments."""

    pipelines = True  # runs under a pipeline schedule (--pp)

    def __init__(self, placement: Placement):
        self.placement = placement
        self.shapes, self.opt_shardings = placement.shapes, placement.opt_shardings  # of the trained tree
        self.grad_specs, self.grad_shardings = placement.gradient_specs, placement.grad_shardings
        self.frozen_specs = None  # the layout of the tree that gets no gradient

    def param_shardings(self) -> Any:
        """The shardings of the state's params."""
        return self.placement.shardings

    def abstract_params(self) -> Any:
        """The shapes of the state's params."""
        return self.placement.shapes

    def initial(self, params: Any, seed: int) -> Any:
        """Traceable: the state's params around the model's `params` (new parts from `seed`)."""
        return params

    def split(self, params: Any) -> tuple[Any, Any]:
        """The state's params -> (trained tree, frozen tree or None)."""
        return params, None

    def join(self, trained: Any, frozen: Any) -> Any:
        return trained

    def saved(self, params: Any) -> Any:
        """What a checkpoint holds of the state's params."""
        return params

    def restored(self, params: Any, init_source, seed: int) -> Any:
        """A checkpoint's params (`saved`) made whole again: the frozen part rebuilt as the run began."""
        return params

    def merged(self, params: Any) -> Any:
        """The weights to evaluate or serve."""
        return params

    def loss_sums(self, placement: Placement, trained: Any, batch: dict, frozen: Any) -> tuple[jax.Array, jax.Array]:
        """`model_loss_sums` as a function of the trained tree; `placement`: this one or a variant (same tree)."""
        return model_loss_sums(placement, trained, batch)

    def meta(self, init_source, seed: int) -> dict:
        """What the run's metadata records of the training (merged into it)."""
        return {}

    def describe(self, init_source, seed: int) -> list[str]:
        """The lines the run prints about what trains."""
        return []


class LoraTraining(Trainable):
    """Adapters train over a frozen base: the state's params are {"base": frozen weights in the base dtype,
    "lora": adapters}; gradients, moments and checkpoints hold the adapters only."""

    pipelines = False

    def __init__(self, lora: LoraPlacement):
        self.placement, self.lora = lora.base, lora
        self.shapes, self.opt_shardings = lora.shapes, lora.opt_shardings
        self.grad_specs, self.grad_shardings = lora.grad_specs, lora.grad_shardings
        self.frozen_specs = lora.base.specs

    def param_shardings(self) -> Any:
        return {"base": self.placement.shardings, "lora": self.lora.shardings}

    def abstract_params(self) -> Any:
        return {"base": self.lora.base_shapes, "lora": self.lora.shapes}

    def initial(self, params: Any, seed: int) -> Any:
        return {"base": self.lora.cast_base(params), "lora": self.lora.random(seed)}

    def split(self, params: Any) -> tuple[Any, Any]:
        return params["lora"], params["base"]

    def join(self, trained: Any, frozen: Any) -> Any:
        return {"base": frozen, "lora": trained}

    def saved(self, params: Any) -> Any:
        return {"lora": params["lora"]}

    def restored(self, params: Any, init_source, seed: int) -> Any:
        placement = self.placement
        base = load_params(init_source, placement) if init_source is not None else placement.init(seed)
        base = jax.jit(self.lora.cast_base, out_shardings=placement.shardings, donate_argnums=0)(base)
        return {"base": base, "lora": params["lora"]}

    def merged(self, params: Any) -> Any:
        return jax.jit(self.lora.merge, out_shardings=self.placement.shardings)(params["base"], params["lora"])

    def loss_sums(self, placement: Placement, trained: Any, batch: dict, frozen: Any) -> tuple[jax.Array, jax.Array]:
        return self.lora.loss_sums(placement, frozen, trained, batch)

    def meta(self, init_source, seed: int) -> dict:
        """The adapters and the base they sit on (its folder, or the seed of a random base)."""
        base = str(init_source) if init_source is not None else None
        return {"lora": {**self.lora.spec.meta(), "base": base, "base_seed": seed}}

    def describe(self, init_source, seed: int) -> list[str]:
        spec, lora = self.lora.spec, self.lora
        lines = [
            f"LoRA: rank {spec.rank}, alpha {spec.alpha:g} on {len(lora.targets)} weights "
            f"({lora.n_params():,} trainable parameters); base frozen in {spec.base_dtype}"
        ]
        if init_source is None:
            lines.append(
                "note: --lora_rank without --init_from: the frozen base is random weights (seed "
                f"{seed}), so the adapters fine-tune nothing; give --init_from=MODEL for a real base"
            )
        return lines


def trainable_for(cfg, placement: Placement) -> Trainable:
    """The run's: adapters with `--lora_rank` > 0 (their targets found and laid out now, before any data or
    compile work: a bad --lora_targets is one line), else every weight."""
    if not getattr(cfg, "lora_rank", 0):
        return Trainable(placement)
    spec = LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_base_dtype)
    return LoraTraining(place_lora(placement, spec))


def trained_by(placement: Placement, trainable: Trainable | None) -> Trainable:
    """`trainable`, or every weight of `placement` when none is given."""
    return trainable if trainable is not None else Trainable(placement)


__all__ = ["Trainable", "LoraTraining", "trainable_for", "trained_by", "model_loss_sums"]
