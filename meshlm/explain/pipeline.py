"""What `--pp` does to the train step, for `meshlm explain`: the stage layout, per-stage memory, the
schedule with its bubble, and the stage-to-stage transfers found in the compiled HLO.

Read beside `meshlm.ops.pipeline` (the static schedule tables, read by `meshlm.plan.schedule`) and
`meshlm.models.pipelined` (the model cut into stages). Facts the figures rest on:
  - every device runs the same SPMD program, so its compiled memory is the same on every pp rank; the
    stash buffer is sized for the rank that needs the most slots (`Schedule.act_slots`, plus a trash slot);
  - every rank sends at every clock that has a forward (an activation to the next rank) and at every clock
    that has a backward (a cotangent to the previous one), idle or not: a rank with nothing to do sends
    its trash slot, so the compiled transfers are (forward clocks + backward clocks) × one microbatch;
  - the embedding and head tables are replicated over pp; the embedding lookup runs at every forward
    clock and the head at every backward clock on every rank (only stage 0's, resp. the last stage's,
    result is kept), and their gradients are summed over pp.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshlm.explain.analysis import CollectiveRow
from meshlm.models.placement import Placement
from meshlm.ops.pipeline import Schedule
from meshlm.plan.schedule import clock_counts, rank_load
from meshlm.strategy.rules import flatten

AXIS = "pp"


# ------------------------------------------------------------------------------------- the schedule


def schedule_picture(schedule: Schedule, max_width: int = 160) -> str:
    """Rank × clock: `F3` a forward of microbatch 3, `B3` a backward, both in one clock `F3B1`, `·` idle;
    with virtual stages `F3.1` is microbatch 3 on the rank's virtual stage 1. Long schedules are cut into
    bands of clocks, each at most `max_width` characters wide."""
    pp, V, T = schedule.pp, schedule.virtual, schedule.clocks

    def part(letter, entry):
        active, k, i = entry[:3]
        if not active:
            return ""
        return f"{letter}{i}" + (f".{k // pp}" if V > 1 else "")

    cells = [
        [part("F", schedule.fwd[t, r]) + part("B", schedule.bwd[t, r]) or "·" for t in range(T)] for r in range(pp)
    ]
    width = max(len(c) for row in cells for c in row + [str(T - 1)])
    label = len(f"rank {pp - 1}")
    per_band = max(1, (max_width - label) // (width + 1))
    bands = []
    for start in range(0, T, per_band):
        clocks = range(start, min(T, start + per_band))
        rows = [("clock".ljust(label) + " " + " ".join(str(t).ljust(width) for t in clocks))]
        rows += [f"rank {r}".ljust(label) + " " + " ".join(cells[r][t].ljust(width) for t in clocks) for r in range(pp)]
        bands.append("\n".join(line.rstrip() for line in rows))
    return "\n\n".join(bands)


def describe(schedule: Schedule) -> dict:
    fwd, bwd = clock_counts(schedule)
    return dict(
        name=schedule.name,
        pp=schedule.pp,
        virtual_stages=schedule.virtual,
        stages=schedule.pp * schedule.virtual,
        microbatches=schedule.microbatches,
        clocks=schedule.clocks,
        forward_clocks=fwd,
        backward_clocks=bwd,
        bubble=schedule.bubble(),
        theoretical_bubble=schedule.theoretical_bubble(),
        act_slots=schedule.act_slots,
        cot_slots=schedule.cot_slots,
        ranks=rank_load(schedule),
        picture=schedule_picture(schedule),
    )


# ---------------------------------------------------------------------------------- the stage layout


def _rank_devices(mesh, r: int) -> list[int]:
    return sorted(d.id for d in np.asarray(mesh.devices)[r].ravel())


def _held_range(placement: Placement, path: str, r: int, dim: int = 0) -> tuple[int, int]:
    """[start, stop) of dimension `dim` of a parameter that rank r's devices hold."""
    s = flatten(placement.shapes)[path]
    index = NamedSharding(placement.mesh, flatten(placement.specs)[path]).devices_indices_map(tuple(s.shape))
    first = np.asarray(placement.mesh.devices)[r].ravel()[0]
    return index[first][dim].indices(s.shape[dim])[:2]


def _span(a: int, b: int) -> str:
    return f"{a}" if b - a == 1 else f"{a}-{b - 1}"


def stage_layout(placement: Placement, schedule: Schedule) -> list[dict]:
    """Per pp rank: its devices, the layers it stores (read from the layers' sharding), the stages it runs
    and their layers, and what it holds and runs of the embedding and the head."""
    pp, V = schedule.pp, schedule.virtual
    S, L = pp * V, placement.cfg.n_layers
    specs = flatten(placement.specs)
    layer_path = next(p for p in specs if p.startswith("layers/"))
    head = [p for p in specs if not p.startswith("layers/") and p != "embed"]  # final_norm, lm_head
    replicated = lambda p: all(AXIS not in (e if isinstance(e, tuple) else (e,)) for e in specs[p])  # noqa: E731
    rows = []
    for r in range(pp):
        stages = [v * pp + r for v in range(V)]
        row = dict(
            rank=r,
            devices=_rank_devices(placement.mesh, r),
            layers_stored=_span(*_held_range(placement, layer_path, r)),
            stages=[dict(stage=k, layers=_span(k * L // S, (k + 1) * L // S)) for k in stages],
        )
        row["embed"] = ("whole (replicated over pp)" if replicated("embed") else "a pp shard") + (
            "; its lookup is stage 0's input" if r == 0 else "; lookup computed, discarded"
        )
        row["head"] = ("whole (replicated over pp)" if all(map(replicated, head)) else "pp shards") + (
            f"; runs stage {S - 1}'s head and loss" if (S - 1) % pp == r else "; computed, discarded"
        )
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ memory


def _shard_bytes(x) -> int:
    return math.prod(x.sharding.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize


def state_split(abstract_state) -> dict:
    """Per-device bytes of the train state by what it belongs to: the stacked layers (a stage's share
    with pp) and the rest (embedding, head, step counters; whole on every stage)."""
    out = {"layers": 0, "embedding+head": 0}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        key = "layers" if "'layers'" in jax.tree_util.keystr(path) else "embedding+head"
        out[key] += _shard_bytes(leaf)
    return out


def stage_memory(compiled_step, abstract_state, batch: dict, microbatch_bytes: int | None, schedule: Schedule) -> dict:
    """Per-device memory of one stage: the compiled step's figures (the same program runs on every rank)
    beside the schedule's stash: slots × one microbatch's stage input, as compiled and per rank."""
    ma = compiled_step.memory_analysis()
    batch_bytes = sum(_shard_bytes(b) for b in batch.values())
    mb = microbatch_bytes or 0
    split = state_split(abstract_state)
    return {
        "params+opt_state": int(ma.argument_size_in_bytes - batch_bytes),
        "state_layers": split["layers"],
        "state_embedding+head": split["embedding+head"],
        "batch": int(batch_bytes),
        "temporaries": int(ma.temp_size_in_bytes),
        "microbatch_bytes": mb,
        # the buffers every rank allocates: the slots of the most loaded rank plus one trash slot each
        "stash_buffer": (schedule.act_slots + 1) * mb,
        "cotangent_buffer": (schedule.cot_slots + 1) * mb,
        "stash_by_rank": [r["stash"] * mb for r in rank_load(schedule)],
        "in_flight_by_rank": [r["in_flight"] * mb for r in rank_load(schedule)],
    }


# --------------------------------------------------------------------------------------- transfers


def role(row: CollectiveRow) -> str:
    """What a collective over the pp axis is for ('' for the others)."""
    if AXIS not in row.axes:
        return ""
    if row.kind == "collective-permute" and row.where.endswith("ppermute"):
        return "stage transfer"
    if row.kind in ("all-to-all", "collective-permute") and row.where.endswith(("reshape", "transpose")):
        return "layers to virtual stages"  # the stored [L] stack cut into interleaved [pp, V] stages, and back
    if row.kind == "all-reduce" and "psum" in row.where:
        return "sum over stages"
    return "over pp"


def transfers(rows: list[CollectiveRow], schedule: Schedule, microbatch_shape: tuple, itemsize: int) -> dict:
    """The stage transfers of the compiled step (collective-permutes over pp from the pipeline's ppermute)
    beside what the schedule implies: one message per forward clock and one per backward clock."""
    mine = [c for c in rows if role(c) == "stage transfer"]
    relayout = [c for c in rows if role(c) == "layers to virtual stages"]
    sizes = sorted({c.payload_bytes for c in mine})
    fwd, bwd = clock_counts(schedule)
    per = sizes[0] if len(sizes) == 1 else None
    full = math.prod(microbatch_shape) * itemsize
    loads = rank_load(schedule)
    return {
        "compiled": {
            "ops": len(mine),
            "count": sum(c.count for c in mine),
            "bytes": sum(c.total_bytes for c in mine),
            "payload_bytes": sizes,
        },
        "expected": {
            "activations": fwd,
            "cotangents": bwd,
            "count": fwd + bwd,
            "bytes": (fwd + bwd) * per if per else None,
        },
        "microbatch_shape": list(microbatch_shape),
        "microbatch_bytes": full,
        "per_device_bytes": per,
        "relayout_bytes": sum(c.total_bytes for c in relayout),
        "useful_by_rank": [dict(rank=r["rank"], activations=r["acts_sent"], cotangents=r["cots_sent"]) for r in loads],
    }
