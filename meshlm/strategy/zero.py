"""ZeRO stages (`--zero_stage=0|1|2|3`) over a strategy's data axes: the mesh axes its batch splits over.

    stage   parameters   gradients   optimizer state   per-device bytes (fp32 params, grads, Adam moments)
    0       replicated   replicated  replicated        4Ψ + 4Ψ + 8Ψ       = 16Ψ
    1       replicated   replicated  sharded           4Ψ + 4Ψ + 8Ψ/N
    2       replicated   sharded     sharded           4Ψ + 12Ψ/N
    3       sharded      sharded     sharded           16Ψ/N

(Ψ parameters, N devices over the data axes; fp32 parameters and no master copy, unlike the paper.)

"Sharded": the weights' `embed` dimension goes over the data axes. Stages 0–2 combine gradients in one
explicit collective (all-reduce for 0 and 1, reduce-scatter for 2; `meshlm.train.step`); stage 3 leaves
the collectives to XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshlm.errors import UsageError
from meshlm.sharding import MeshAxes, Strategy, as_tuple, filter_axes

STAGES = (0, 1, 2, 3)


def _replicate(table: Mapping[str, MeshAxes], data: tuple[str, ...]) -> dict[str, MeshAxes]:
    return {k: filter_axes(v, drop=data) for k, v in table.items()}


def _shard(table: Mapping[str, MeshAxes], data: tuple[str, ...]) -> dict[str, MeshAxes]:
    out = _replicate(table, data)
    out["embed"] = filter_axes(data + as_tuple(out.get("embed")))
    return out


def with_zero_stage(strategy: Strategy, stage: int | None) -> Strategy:
    """The strategy with its parameters, gradients and optimizer state laid out for this ZeRO stage."""
    if stage is None:
        return strategy
    if stage not in STAGES:
        raise UsageError(
            f"--zero_stage={stage}: choose 0 (replicate), 1 (shard optimizer state), "
            "2 (and gradients) or 3 (and parameters)"
        )
    data = as_tuple(strategy.activations.get("batch"))
    base = strategy.params
    rep, shard = _replicate(base, data), _shard(base, data)
    return dataclasses.replace(
        strategy,
        name=f"{strategy.name}+zero{stage}",
        zero_stage=stage,
        params=shard if stage >= 3 else rep,
        grads=shard if stage >= 2 else rep,
        opt_state=shard if stage >= 1 else rep,
    )


def check_pipelined(strategy: Strategy, sizes: Mapping[str, int], pipelined: bool) -> None:
    """Stages 0-2 combine the gradients in the step's own collective over the data axes, which a
    pipelined step does not run (it keeps XLA's): refused with `--pp` where the batch splits over a
    data axis of more than one device (`sizes`: the mesh axes' sizes)."""
    stage = strategy.zero_stage
    split = any(sizes.get(a, 1) > 1 for a in as_tuple(strategy.activations.get("batch")))
    if pipelined and split and stage is not None and stage < 3:
        raise UsageError(
            f"--zero_stage={stage} with --pp: the pipeline keeps XLA's collectives; use --zero_stage=3 or none"
        )


def formula_bytes(stage: int, n_params: int, n: int, param_bytes: int = 4) -> dict[str, float]:
    """Per-device params, grads and optimizer-state bytes of a stage (Adam: two moments per parameter)."""
    p, g, o = param_bytes * n_params, param_bytes * n_params, 2 * param_bytes * n_params
    return {
        "params": p / n if stage >= 3 else p,
        "grads": g / n if stage >= 2 else g,
        "opt_state": o / n if stage >= 1 else o,
    }
