"""Pipeline parallelism over the `pp` mesh axis: GPipe, 1F1B and interleaved 1F1B.

The model's depth is cut into S = pp × V stages (stage k on rank k mod pp) and a batch into M
microbatches. Which rank does what in each clock is a static table made here by simulating the
schedule (`build_schedule`); ranks pass activations forward and cotangents back with `lax.ppermute`
over a ring. A rank stashes each in-flight microbatch's stage input and recomputes the stage forward
in its backward pass; gradients are summed in float32 in the table's order. The executor is a
`lax.scan` over clocks inside a `jax.shard_map` manual over `pp` only, so the other mesh axes stay
automatic inside each stage. docs/pipeline.md, "The schedule executor", has the details.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshlm.errors import UsageError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
FWD, BWD = 1, 2


@dataclass(frozen=True)
class Schedule:
    """The static plan. At clock t, rank r runs at most one forward, `fwd[t, r]`, and one backward,
    `bwd[t, r]`, each (active, stage, microbatch, stash slot, cotangent slot); `recv_act[t, r]` and
    `recv_cot[t, r]` are the slots where what arrives at the end of clock t is kept (the last slot of
    each buffer is a trash slot for "nothing"). `kinds[t]` says whether anyone runs a forward (1),
    a backward (2) or both (3) at clock t: every rank runs the same program, so a clock costs a
    forward, a backward, or both, on every rank."""

    name: str
    pp: int
    virtual: int
    microbatches: int
    fwd: np.ndarray  # [T, pp, 5] int32
    bwd: np.ndarray  # [T, pp, 5] int32
    recv_act: np.ndarray  # [T, pp] int32
    recv_cot: np.ndarray  # [T, pp] int32
    kinds: np.ndarray  # [T] int32
    act_slots: int
    cot_slots: int

    @property
    def clocks(self) -> int:
        return len(self.kinds)

    def segments(self) -> list[tuple[int, int, int]]:
        """(kind, first clock, end clock) runs of clocks of one kind: one scan each."""
        out, start = [], 0
        for t in range(1, self.clocks + 1):
            if t == self.clocks or self.kinds[t] != self.kinds[start]:
                out.append((int(self.kinds[start]), start, t))
                start = t
        return out

    def length(self, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> float:
        """The schedule's length, in the time one rank takes for a forward of all its layers on one
        microbatch (a backward with recomputation costs about twice that)."""
        f, b = fwd_cost / self.virtual, bwd_cost / self.virtual
        return float(sum((f if k & FWD else 0.0) + (b if k & BWD else 0.0) for k in self.kinds))

    def bubble(self, fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> float:
        """Idle share of each rank's time: 1 - useful work / schedule length."""
        return 1.0 - self.microbatches * (fwd_cost + bwd_cost) / self.length(fwd_cost, bwd_cost)

    def theoretical_bubble(self) -> float:
        """(p - 1) / (m·v + p - 1): the bubble of a pipeline whose stages take equal time."""
        p, m, v = self.pp, self.microbatches, self.virtual
        return (p - 1) / (m * v + p - 1)


def schedule_for_job(
    name: str,
    pp: int,
    microbatches: int | None,
    virtual: int,
    n_layers: int,
    batch_size: int,
    grad_accum: int,
    data: int,
):
    """The `--pp` flags checked against the job (one line each, before anything compiles) and the schedule
    they give. `microbatches` None: 2 × pp; `data`: dp × fsdp, the ways each micro-batch's rows split."""
    micro = microbatches or 2 * pp
    check(name, pp, micro, virtual, n_layers)
    if grad_accum > 1:
        raise UsageError("--grad_accum with --pp: the pipeline's --microbatches already accumulate; drop --grad_accum")
    if batch_size % (micro * data):
        raise UsageError(
            f"--batch_size={batch_size} does not split into --microbatches={micro} of rows "
            f"divisible by dp×fsdp = {data}; use a multiple of {micro * data}"
        )
    return build_schedule(name, pp, micro, virtual)


def check(name: str, pp: int, microbatches: int, virtual: int, n_layers: int | None = None) -> None:
    """The pipeline flags, checked before anything compiles; one line naming the fix."""
    if name not in SCHEDULES:
        raise UsageError(f"--pipeline_schedule={name}: choose one of {', '.join(SCHEDULES)}")
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise UsageError("--pp, --microbatches and --virtual_stages must be positive integers")
    if virtual > 1 and name != "interleaved":
        raise UsageError(f"--virtual_stages={virtual} needs --pipeline_schedule=interleaved")
    if name == "interleaved" and microbatches % pp:
        raise UsageError(
            f"--microbatches={microbatches} is not a multiple of --pp={pp}, which the interleaved "
            f"schedule needs; use --microbatches={(microbatches // pp + 1) * pp}"
        )
    if pp > 1 and microbatches < pp:
        raise UsageError(
            f"--microbatches={microbatches} is fewer than the --pp={pp} stages: the pipeline would "
            f"never fill; use --microbatches={pp} or more"
        )
    if n_layers is not None and n_layers % (pp * virtual):
        raise UsageError(
            f"the model's {n_layers} layers do not split into --pp={pp} × --virtual_stages={virtual} "
            f"= {pp * virtual} equal stages; choose a pp × virtual_stages that divides {n_layers}"
        )


def rank_order(name: str, pp: int, M: int, V: int, r: int) -> list[tuple[int, int, int]]:
    """The (kind, stage, microbatch) actions of rank r, in the order it runs them.

    gpipe: every forward, then every backward. 1f1b: 2(pp - r - 1) forwards to fill the pipeline
    (a clock pairs one forward with one backward, so the fill is twice the classic pp - r - 1), then
    a forward and a backward in turn, then the remaining backwards. interleaved: the same over V·M
    virtual microbatches, taken in groups of pp microbatches per stage, forwards through the rank's
    stages in order and backwards in reverse, with 2(pp - r - 1) + (V - 1)·pp warm-up forwards.
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
    warm = min(n, 2 * (pp - r - 1) + (V - 1) * pp)
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
        row = [[(0, 0, 0, -1, -1), (0, 0, 0, -1, -1)] for _ in range(pp)]  # [fwd, bwd] per rank
        for r in range(pp):
            done_kinds = set()
            while nxt[r] < len(orders[r]):  # at most one forward and one backward, in the rank's order
                kind, k, i = orders[r][nxt[r]]
                if kind in done_kinds or not ready(kind, k, i, t):
                    break
                done_kinds.add(kind)
                nxt[r] += 1
                if kind == FWD:  # (stage 0 needs no stash: it recomputes its input from the tokens)
                    fwd_at[k, i] = t
                    row[r][0] = (1, k, i, act_slot[k, i], -1)
                else:
                    bwd_at[k, i] = t
                    row[r][1] = (1, k, i, act_slot[k, i], cot_slot[k, i])
        # slots are freed after the clock: a forward and a backward in the same clock never share one
        for r in range(pp):
            active, _, _, a_slot, c_slot = row[r][1]
            if active and a_slot >= 0:
                free_act[r].append(a_slot)
            if active and c_slot >= 0:
                free_cot[r].append(c_slot)
        # messages sent this clock land at its end
        ra, rc = [-1] * pp, [-1] * pp
        for r in range(pp):
            (fa, fk, fi, _, _), (ba, bk, bi, _, _) = row[r]
            if fa and fk < S - 1:
                dst = (r + 1) % pp
                act_slot[fk + 1, fi] = ra[dst] = take(free_act, n_act, dst)
                arrived[fk + 1, fi] = t
            if ba and bk > 0:
                dst = (r - 1) % pp
                cot_slot[bk - 1, bi] = rc[dst] = take(free_cot, n_cot, dst)
                cot_arrived[bk - 1, bi] = t
        rows.append(row)
        recv_a.append(ra)
        recv_c.append(rc)
        t += 1
    A, C = max(max(n_act), 1), max(max(n_cot), 1)
    table = np.asarray(rows, np.int32)  # [T, pp, 2, 5]
    table[..., 3] = np.where(table[..., 3] < 0, A, table[..., 3])  # no slot: the trash slot
    table[..., 4] = np.where(table[..., 4] < 0, C, table[..., 4])
    recv_a = np.where(np.asarray(recv_a) < 0, A, recv_a).astype(np.int32)
    recv_c = np.where(np.asarray(recv_c) < 0, C, recv_c).astype(np.int32)
    kinds = (table[:, :, 0, 0].any(axis=1) * FWD + table[:, :, 1, 0].any(axis=1) * BWD).astype(np.int32)
    return Schedule(name, pp, virtual, M, table[:, :, 0], table[:, :, 1], recv_a, recv_c, kinds, A, C)


def pipeline_value_and_grad(
    first_fn: Callable[[Any, Any], jax.Array],
    stage_fn: Callable[[Any, jax.Array, Any], jax.Array],
    head_fn: Callable[[Any, jax.Array, Any], jax.Array],
    first_params: Any,
    stage_params: Any,
    head_params: Any,
    side: Any,
    schedule: Schedule,
    mesh,
    axis: str = "pp",
):
    """Loss and gradients of `sum_i head_fn(head, stage_{S-1}(... stage_0(first_fn(first, s_i), s_i)), s_i)`.

    first_params, head_params: replicated over `axis`. first_fn(first, s_i) -> x: the first stage's
        input for microbatch i (the embedding); head_fn(head, x, s_i) -> scalar (its share of the loss).
    stage_params: leaves shaped [pp, V, ...], sharded over `axis` on dim 0; stage k = v·pp + r is
        `leaf[r, v]`. stage_fn(one stage's params, x, s_i) -> x of the same shape.
    side: a pytree of [M, ...] arrays, s_i its i-th slices (tokens, targets, positions, segment ids).
    Returns (loss, (d first_params, d stage_params, d head_params)).

    No rank branches on its own data: collectives inside a stage (tp, sp, fsdp) need every rank in
    step. A rank with nothing to do in a clock computes on its trash slot and throws the result away.
    """
    per_rank = _rank_program(first_fn, stage_fn, head_fn, schedule, axis)
    stage_spec = jax.tree.map(lambda _: P(axis), stage_params)
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    by_rank = P(None, axis)
    fn = jax.shard_map(
        per_rank,
        mesh=mesh,
        axis_names={axis},
        in_specs=(rep(first_params), stage_spec, rep(head_params), rep(side), *(by_rank,) * 4),
        out_specs=(P(), rep(first_params), stage_spec, rep(head_params)),
        check_vma=False,
    )
    tables = (schedule.fwd, schedule.bwd, schedule.recv_act, schedule.recv_cot)
    loss, gf, g, gh = fn(first_params, stage_params, head_params, side, *(jnp.asarray(a) for a in tables))
    return loss, (gf, g, gh)


def _rank_program(first_fn, stage_fn, head_fn, schedule: Schedule, axis: str):
    """The program one pp rank runs inside `pipeline_value_and_grad`'s shard_map: the schedule's
    clocks as scans, then the loss and the gradients summed over `axis`."""
    pp = schedule.pp
    A, C = schedule.act_slots, schedule.cot_slots
    fwd_perm = [(r, (r + 1) % pp) for r in range(pp)]
    bwd_perm = [(r, (r - 1) % pp) for r in range(pp)]

    def per_rank(first, params, head, side_, fwd_t, bwd_t, recv_a, recv_c):
        params = jax.tree.map(lambda a: a[0], params)  # [V, ...]: this rank's virtual stages
        fwd_t, bwd_t, recv_a, recv_c = fwd_t[:, 0], bwd_t[:, 0], recv_a[:, 0], recv_c[:, 0]
        probe = jax.eval_shape(first_fn, first, jax.tree.map(lambda a: a[0], side_))
        h_shape, dtype = probe.shape, probe.dtype
        forward, backward = _stage_steps(first_fn, stage_fn, head_fn, schedule, first, params, head, side_, dtype)

        def clock(kind):
            def run(carry, t):  # compute first, then deliver: an arrival may reuse a slot read this clock
                if kind & FWD:
                    carry, y = forward(carry, fwd_t[t])
                if kind & BWD:
                    carry, dx = backward(carry, bwd_t[t])
                if kind & FWD:
                    carry = (carry[0].at[recv_a[t]].set(jax.lax.ppermute(y, axis, fwd_perm)), *carry[1:])
                if kind & BWD:
                    carry = (carry[0], carry[1].at[recv_c[t]].set(jax.lax.ppermute(dx, axis, bwd_perm)), *carry[2:])
                return carry, None

            return run

        zeros32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
        carry = (
            jnp.zeros((A + 1, *h_shape), dtype),
            jnp.zeros((C + 1, *h_shape), dtype),
            zeros32(params),
            zeros32(first),
            zeros32(head),
            jnp.zeros((), jnp.float32),
        )
        for kind, start, end in schedule.segments():
            carry, _ = jax.lax.scan(clock(kind), carry, jnp.arange(start, end))
        _, _, g, gf, gh, loss = carry
        g = jax.tree.map(lambda G, p: G.astype(p.dtype)[None], g, params)
        summed = lambda G, p: jax.lax.psum(G, axis).astype(p.dtype)  # noqa: E731
        return jax.lax.psum(loss, axis), jax.tree.map(summed, gf, first), g, jax.tree.map(summed, gh, head)

    return per_rank


def _stage_steps(first_fn, stage_fn, head_fn, schedule: Schedule, first, params, head, side_, dtype):
    """`_rank_program`'s forward and backward of one stage in a clock, each `(carry, row) -> (carry, out)`
    over the carry (stashed inputs, cotangents, stage/first/head gradients, loss) and a row of the
    schedule's tables: the forward returns the stage's output, the backward the cotangent of its input.
    `params`: this rank's virtual stages ([V, ...]); `dtype`: the stream's."""
    pp, S = schedule.pp, schedule.pp * schedule.virtual

    def stage_at(v):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, keepdims=False), params)

    def side_at(i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), side_)

    def stage_input(fp, k, s_i, stashed):
        return jnp.where(k == 0, first_fn(fp, s_i).astype(dtype), stashed)

    def forward(carry, row):
        acts, cots, g, gf, gh, loss = carry
        active, k, i, aslot, _ = (row[j] for j in range(5))
        s_i = side_at(i)
        y = stage_fn(stage_at(k // pp), stage_input(first, k, s_i, acts[aslot]), s_i)
        return (acts, cots, g, gf, gh, loss), y

    def backward(carry, row):
        acts, cots, g, gf, gh, loss = carry
        active, k, i, aslot, cslot = (row[j] for j in range(5))
        v, s_i, last = k // pp, side_at(i), (k == S - 1)
        cot = jax.lax.stop_gradient(cots[cslot])

        def objective(fp, p, hp, x):  # the last stage's loss, or the pull-back of the next stage's cotangent
            y = stage_fn(p, stage_input(fp, k, s_i, x), s_i)
            out = head_fn(hp, y, s_i).astype(jnp.float32)
            pulled = jnp.vdot(y.astype(jnp.float32), cot.astype(jnp.float32))
            return jnp.where(last, out, pulled), out

        (_, out), (df, dp, dh, dx) = jax.value_and_grad(objective, argnums=(0, 1, 2, 3), has_aux=True)(
            first, stage_at(v), head, acts[aslot]
        )
        on = active == 1
        g = jax.tree.map(lambda G, d: jnp.where(on, G.at[v].add(d.astype(G.dtype)), G), g, dp)
        gf = jax.tree.map(lambda G, d: jnp.where(on & (k == 0), G + d.astype(G.dtype), G), gf, df)
        gh = jax.tree.map(lambda G, d: jnp.where(on & last, G + d.astype(G.dtype), G), gh, dh)
        loss = jnp.where(on & last, loss + out, loss)
        return (acts, cots, g, gf, gh, loss), dx.astype(dtype)

    return forward, backward
