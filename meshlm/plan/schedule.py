"""Readings of a pipeline's static schedule table (`meshlm.ops.pipeline.build_schedule`).

The table says which stage runs which microbatch in each clock; everything the plan and
`meshlm explain --pp` say about a schedule is read from it here, not from a second formula: the
clock at which each stage runs each microbatch, what each rank keeps in flight and stashes, the
messages that carry a microbatch, the clocks with a forward and with a backward, and the layers
each rank runs.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from meshlm.ops.pipeline import BWD, FWD, Schedule, build_schedule
from meshlm.plan.job import PipelineFlags


@lru_cache(maxsize=128)
def _schedule(name: str, pp: int, M: int, V: int) -> Schedule:
    return build_schedule(name, pp, M, V)


def schedule_of(flags: PipelineFlags, pp: int) -> Schedule:
    """The static schedule table `meshlm train` runs for these flags on pp stages."""
    return _schedule(flags.schedule, pp, flags.microbatches_for(pp), flags.virtual_stages)


def action_clocks(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """[S, M] arrays: the clock at which each stage ran its forward, and its backward, of each microbatch."""
    S, M = schedule.pp * schedule.virtual, schedule.microbatches
    fwd_at, bwd_at = np.full((S, M), -1), np.full((S, M), -1)
    for table, at in ((schedule.fwd, fwd_at), (schedule.bwd, bwd_at)):
        for t, r in zip(*np.nonzero(table[:, :, 0])):
            at[table[t, r, 1], table[t, r, 2]] = t
    return fwd_at, bwd_at


def rank_load(schedule: Schedule) -> list[dict]:
    """Per pp rank, from the table: the most microbatches in flight at once (forward run, backward not yet),
    the most stage inputs stashed at once (arrived, backward not yet run: what the activation buffer must
    hold), and the messages that carry a microbatch (activations sent forward, cotangents sent back)."""
    pp, S = schedule.pp, schedule.pp * schedule.virtual
    fwd_at, bwd_at = action_clocks(schedule)
    clocks = np.arange(schedule.clocks)[:, None, None]
    out = []
    for r in range(pp):
        mine = [k for k in range(S) if k % pp == r]
        flying = ((fwd_at[mine][None] <= clocks) & (clocks < bwd_at[mine][None])).sum(axis=(1, 2))
        held = [k for k in mine if k > 0]  # stage 0 recomputes its input from the tokens: no stash
        stashed = (
            ((fwd_at[[k - 1 for k in held]][None] <= clocks) & (clocks < bwd_at[held][None])).sum(axis=(1, 2))
            if held
            else np.zeros(1, int)
        )
        out.append(
            dict(
                rank=r,
                in_flight=int(np.max(flying)),
                stash=int(np.max(stashed)),
                acts_sent=int(sum(schedule.microbatches for k in mine if k < S - 1)),
                cots_sent=int(sum(schedule.microbatches for k in mine if k > 0)),
            )
        )
    return out


def in_flight_per_rank(schedule: Schedule) -> list[int]:
    """Stage inputs each rank stashes at its busiest."""
    return [r["stash"] for r in rank_load(schedule)]


def clock_counts(schedule: Schedule) -> tuple[int, int]:
    """(clocks with a forward, clocks with a backward): every rank runs, and sends, in each."""
    return int(np.count_nonzero(schedule.kinds & FWD)), int(np.count_nonzero(schedule.kinds & BWD))


def stage_layers(n_layers: int, schedule: Schedule, rank: int) -> list[tuple[int, int]]:
    """[first, last] layer of each stage this rank runs."""
    per = n_layers // (schedule.pp * schedule.virtual)
    return [((v * schedule.pp + rank) * per, (v * schedule.pp + rank + 1) * per - 1) for v in range(schedule.virtual)]
