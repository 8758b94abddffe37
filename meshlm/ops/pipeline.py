"""Pipeline parallelism over the `pp` mesh axis: GPipe, 1F1B and interleaved 1F1B.

The model's depth is cut into S = pp × V stages; stage k lives on pp rank k mod pp (V "virtual"
stages per rank when V > 1, interleaved). A batch is cut into M microbatches. Time runs in clocks;
in each clock every rank does at most one thing, a stage's forward or backward pass for one
microbatch, then ranks pass activations to the next rank and cotangents to the previous one with
`lax.ppermute` (a ring, so that interleaved stages wrap from the last rank to the first).

Which rank does what when is a static table, made here in plain Python by simulating the schedule:

    gpipe        every forward, then every backward: simple, holds all M microbatches' inputs
    1f1b         at most pp - rank microbatches in flight; a backward goes first whenever it can:
                 memory bounded by pp microbatches, the same bubble as GPipe
    interleaved  1F1B over V virtual stages per rank: the bubble shrinks by V, more messages

A rank keeps only each in-flight microbatch's *input* to its stage (the stash); its backward pass
recomputes the stage forward under `jax.vjp`. So a rank's activation memory is (stash slots) × (one
microbatch's activation) + one stage's working set, and the stash size is the schedule's in-flight
bound, which the table also fixes. Gradients are summed over microbatches in float32 order fixed by
the table: exact up to summation order.

The executor is a `lax.scan` over clocks inside `jax.shard_map` that is manual over `pp` only, so
the other mesh axes (batch over dp/fsdp, heads over tp) stay automatic inside each stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshlm.errors import UsageError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
IDLE, FWD, BWD = 0, 1, 2


@dataclass(frozen=True)
class Schedule:
    """The static plan: `table[t, r]` = (kind, stage, microbatch, stash slot, cotangent slot) for rank
    r at clock t, and `recv_act[t, r]` / `recv_cot[t, r]` = the slot where rank r stores what arrives
    at the end of clock t (the trash slot when nothing does)."""

    name: str
    pp: int
    virtual: int
    microbatches: int
    table: np.ndarray  # [T, pp, 5] int32
    recv_act: np.ndarray  # [T, pp] int32
    recv_cot: np.ndarray  # [T, pp] int32
    act_slots: int
    cot_slots: int

    @property
    def clocks(self) -> int:
        return self.table.shape[0]

    @property
    def bubble(self) -> float:
        """Share of rank-clocks spent idle (forward and backward counted as one clock each)."""
        return float((self.table[..., 0] == IDLE).mean())

    def theoretical_bubble(self) -> float:
        """(p - 1) / (m·v + p - 1): the bubble of a pipeline whose stages take equal time."""
        p, m, v = self.pp, self.microbatches, self.virtual
        return (p - 1) / (m * v + p - 1)


def check(name: str, pp: int, microbatches: int, virtual: int, n_layers: int | None = None) -> None:
    """The pipeline flags, checked before anything compiles; one line naming the fix."""
    if name not in SCHEDULES:
        raise UsageError(f"--pipeline_schedule={name}: choose one of {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise UsageError("--pp, --microbatches and --virtual_stages must be positive integers")
    if virtual > 1 and name != "interleaved":
        raise UsageError(f"--virtual_stages={virtual} needs --pipeline_schedule=interleaved")
    if name == "interleaved" and microbatches % pp:
        raise UsageError(f"--microbatches={microbatches} is not a multiple of --pp={pp}, which the interleaved "
                         f"schedule needs; use --microbatches={(microbatches // pp + 1) * pp}")
    if pp > 1 and microbatches < pp:
        raise UsageError(f"--microbatches={microbatches} is fewer than the --pp={pp} stages: the pipeline would "
                         f"never fill; use --microbatches={pp} or more")
    if n_layers is not None and n_layers % (pp * virtual):
        raise UsageError(f"the model's {n_layers} layers do not split into --pp={pp} × --virtual_stages={virtual} "
                         f"= {pp * virtual} equal stages; choose a pp × virtual_stages that divides {n_layers}")


def rank_order(name: str, pp: int, M: int, V: int, r: int) -> list[tuple[int, int, int]]:
    """The (kind, stage, microbatch) actions of rank r, in the order it runs them.

    gpipe: every forward, then every backward. 1f1b: pp - r - 1 forwards to fill the pipeline, then
    one forward and one backward in turn, then the remaining backwards. interleaved: the same over
    V·M virtual microbatches, taken in groups of pp microbatches per stage, forwards through the
    rank's stages in order and backwards in reverse, with 2(pp - r - 1) + (V - 1)·pp warm-up forwards.
    """
    def fwd(j):  # j-th forward of this rank
        group, within = divmod(j, pp * V)
        v = within // pp
        return FWD, v * pp + r, group * pp + within % pp

    def bwd(j):
        group, within = divmod(j, pp * V)
        v = V - 1 - within // pp
        return BWD, v * pp + r, group * pp + within % pp

    n = M * V
    if name == "gpipe":
        return [(FWD, r, i) for i in range(M)] + [(BWD, r, i) for i in range(M)]
    warm = min(n, pp - r - 1 if name == "1f1b" else 2 * (pp - r - 1) + (V - 1) * pp)
    order = [fwd(j) for j in range(warm)]
    for j in range(n - warm):
        order += [fwd(warm + j), bwd(j)]
    return order + [bwd(j) for j in range(n - warm, n)]


def build_schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Simulate the schedule clock by clock and record who does what, and where inputs are kept."""
    check(name, pp, microbatches, virtual)
    S, M = pp * virtual, microbatches
    fwd_at = np.full((S, M), -1)  # the clock a stage's forward of a microbatch ran
    bwd_at = np.full((S, M), -1)
    arrived = np.full((S, M), -1)  # the clock at whose end the stage's input arrived (-1: not yet)
    arrived[0, :] = -2  # stage 0 reads the embedded batch, present from the start
    cot_arrived = np.full((S, M), -1)
    act_slot = np.full((S, M), -1)
    cot_slot = np.full((S, M), -1)
    free_act = [list() for _ in range(pp)]
    free_cot = [list() for _ in range(pp)]
    n_act, n_cot = [0] * pp, [0] * pp
    orders = [rank_order(name, pp, M, virtual, r) for r in range(pp)]
    nxt = [0] * pp

    def take(free, counts, r):
        if free[r]:
            return free[r].pop()
        counts[r] += 1
        return counts[r] - 1

    def ready(kind, k, i, t):
        if kind == FWD:
            return arrived[k, i] == -2 or 0 <= arrived[k, i] < t
        return 0 <= fwd_at[k, i] < t and (k == S - 1 or 0 <= cot_arrived[k, i] < t)

    rows, recv_a, recv_c = [], [], []
    t = 0
    while any(nxt[r] < len(orders[r]) for r in range(pp)):
        if t > 4 * S * M + 4 * S:
            raise RuntimeError(f"schedule {name} did not finish (pp={pp}, M={M}, V={virtual})")
        row = [(IDLE, 0, 0, -1, -1)] * pp
        for r in range(pp):
            if nxt[r] == len(orders[r]) or not ready(*orders[r][nxt[r]], t):
                continue  # a rank keeps its order: it waits for what comes next
            kind, k, i = orders[r][nxt[r]]
            nxt[r] += 1
            if kind == FWD:
                if k == 0:
                    act_slot[k, i] = take(free_act, n_act, r)
                fwd_at[k, i] = t
                row[r] = (FWD, k, i, act_slot[k, i], -1)
            else:
                bwd_at[k, i] = t
                row[r] = (BWD, k, i, act_slot[k, i], cot_slot[k, i])
                free_act[r].append(act_slot[k, i])
                if cot_slot[k, i] >= 0:
                    free_cot[r].append(cot_slot[k, i])
        # messages sent this clock land at its end
        ra, rc = [-1] * pp, [-1] * pp
        for r in range(pp):
            kind, k, i = row[r][:3]
            if kind == FWD and k < S - 1:
                dst = (r + 1) % pp
                act_slot[k + 1, i] = ra[dst] = take(free_act, n_act, dst)
                arrived[k + 1, i] = t
            if kind == BWD and k > 0:
                dst = (r - 1) % pp
                cot_slot[k - 1, i] = rc[dst] = take(free_cot, n_cot, dst)
                cot_arrived[k - 1, i] = t
        rows.append(row)
        recv_a.append(ra)
        recv_c.append(rc)
        t += 1
    A, C = max(max(n_act), 1), max(max(n_cot), 1)
    table = np.asarray(rows, np.int32)
    # -1 (no slot) points at the trash slot, the last one of each buffer
    table[..., 3] = np.where(table[..., 3] < 0, A, table[..., 3])
    table[..., 4] = np.where(table[..., 4] < 0, C, table[..., 4])
    recv_a = np.where(np.asarray(recv_a) < 0, A, recv_a).astype(np.int32)
    recv_c = np.where(np.asarray(recv_c) < 0, C, recv_c).astype(np.int32)
    return Schedule(name, pp, virtual, M, table, recv_a, recv_c, A, C)


def _tree_zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def pipeline_value_and_grad(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    head_fn: Callable[[Any, jax.Array, Any], jax.Array],
    stage_params: Any,
    head_params: Any,
    inputs: jax.Array,
    targets: Any,
    schedule: Schedule,
    mesh,
    axis: str = "pp",
):
    """Loss and gradients of `sum_i head_fn(head, stage_{S-1}(... stage_0(inputs[i])), targets[i])`.

    stage_params: leaves shaped [pp, V, ...], sharded over `axis` on dim 0; stage k = v·pp + r is
        `leaf[r, v]`. stage_fn(one stage's params, x) -> x of the same shape.
    head_params: replicated over `axis`; head_fn(head, x, targets_i) -> scalar (its share of the loss).
    inputs: [M, ...] microbatches (the embedded tokens); targets: a pytree of [M, ...] arrays.
    Returns (loss, (d stage_params, d head_params, d inputs)).
    """
    pp, V, S = schedule.pp, schedule.virtual, schedule.pp * schedule.virtual
    table, recv_a, recv_c = (jnp.asarray(a) for a in (schedule.table, schedule.recv_act, schedule.recv_cot))
    A, C = schedule.act_slots, schedule.cot_slots
    fwd_perm = [(r, (r + 1) % pp) for r in range(pp)]
    bwd_perm = [(r, (r - 1) % pp) for r in range(pp)]

    def per_rank(params, head, x0, ys):
        params = jax.tree.map(lambda a: a[0], params)  # [V, ...]: this rank's virtual stages
        r = jax.lax.axis_index(axis)
        h_shape, dtype = x0.shape[1:], x0.dtype

        def stage_at(v):
            return jax.tree.map(lambda a: a[v], params)

        def fwd(carry, k, i, aslot):
            acts, cots, g, gh, loss, gx = carry
            v = k // pp
            x = jnp.where(k == 0, x0[i], acts[aslot])
            acts = acts.at[aslot].set(x)  # stage 0 stashes its input; others already have it there
            return (acts, cots, g, gh, loss, gx), stage_fn(stage_at(v), x), jnp.zeros(h_shape, dtype)

        def bwd(carry, k, i, aslot, cslot):
            acts, cots, g, gh, loss, gx = carry
            v = k // pp
            x = acts[aslot]
            y_i = jax.tree.map(lambda a: a[i], ys)

            def last(_):
                out, pull = jax.vjp(lambda p, hp, x: head_fn(hp, stage_fn(p, x), y_i), stage_at(v), head, x)
                dp, dh, dx = pull(jnp.ones_like(out))
                return out, dp, dh, dx

            def middle(_):
                out, pull = jax.vjp(stage_fn, stage_at(v), x)
                dp, dx = pull(cots[cslot])
                return jnp.zeros((), jnp.float32), dp, _tree_zeros(head), dx

            out, dp, dh, dx = jax.lax.cond(k == S - 1, last, middle, None)
            g = jax.tree.map(lambda G, d: G.at[v].add(d.astype(G.dtype)), g, dp)
            gh = jax.tree.map(lambda G, d: G + d.astype(G.dtype), gh, dh)
            gx = jnp.where(k == 0, gx.at[i].set(dx), gx)
            loss = loss + out.astype(jnp.float32)
            return (acts, cots, g, gh, loss, gx), jnp.zeros(h_shape, dtype), jnp.where(k == 0, 0, dx)

        def idle(carry, *_):
            z = jnp.zeros(h_shape, dtype)
            return carry, z, z

        def clock(carry, t):
            kind, k, i, aslot, cslot = (table[t, r, j] for j in range(5))
            carry, send_act, send_cot = jax.lax.switch(
                kind, [lambda c: idle(c), lambda c: fwd(c, k, i, aslot), lambda c: bwd(c, k, i, aslot, cslot)], carry)
            got_act = jax.lax.ppermute(send_act, axis, fwd_perm)
            got_cot = jax.lax.ppermute(send_cot, axis, bwd_perm)
            acts, cots, g, gh, loss, gx = carry
            acts = acts.at[recv_a[t, r]].set(got_act)
            cots = cots.at[recv_c[t, r]].set(got_cot)
            return (acts, cots, g, gh, loss, gx), None

        carry = (
            jnp.zeros((A + 1, *h_shape), dtype),
            jnp.zeros((C + 1, *h_shape), dtype),
            jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), params),
            jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), head),
            jnp.zeros((), jnp.float32),
            jnp.zeros_like(x0),
        )
        (_, _, g, gh, loss, gx), _ = jax.lax.scan(clock, carry, jnp.arange(schedule.clocks))
        g = jax.tree.map(lambda G, p: G.astype(p.dtype)[None], g, params)
        gh = jax.tree.map(lambda G, p: jax.lax.psum(G, axis).astype(p.dtype), gh, head)
        return jax.lax.psum(loss, axis), g, gh, jax.lax.psum(gx, axis)

    stage_spec = jax.tree.map(lambda _: P(axis), stage_params)
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    fn = jax.shard_map(per_rank, mesh=mesh, axis_names={axis},
                       in_specs=(stage_spec, rep(head_params), P(), rep(targets)),
                       out_specs=(P(), stage_spec, rep(head_params), P()), check_vma=False)
    loss, g, gh, gx = fn(stage_params, head_params, inputs, targets)
    return loss, (g, gh, gx)
