"""Pipeline stages (`--pp`) in the plan: the schedule's own numbers, memory per stage, the bubble and
the stage-to-stage transfers; the estimator for meshes with pp > 1, built on the flat one's terms
(`memory`, `comms`, `cost`, `state_bytes`), which know nothing of stages.

The schedule's clocks, stash and bubble are read from the static table of
`meshlm.ops.pipeline.build_schedule`; every rank pays for the first stage's embedding and the last
stage's head, holds the busiest rank's stash and sends in every clock. Terms other than the stash have
coefficients fitted to XLA:CPU's buffer assignment (`COEFFS`). The schedule flags and their checks are
`meshlm.plan.job.PipelineFlags` and `pipeline_problem`; the table's readings, `meshlm.plan.schedule`.
docs/plan.md, "What the pipelined estimate models", has the details.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

from meshlm import axes
from meshlm.mesh import MeshShape
from meshlm.ops.pipeline import Schedule
from meshlm.plan import comms, cost
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job, Local
from meshlm.plan.memory import BATCH_FIELDS, MemoryPie, saved_per_token_layer
from meshlm.plan.schedule import clock_counts, in_flight_per_rank, schedule_of, stage_layers
from meshlm.plan.state_bytes import local_elements, state_bytes
from meshlm.strategy import DEFAULT

# Buffers of each size live at the compiled peak of a pipelined step: the stash counted whole, the
# other coefficients fitted to XLA:CPU over the fit set in docs/plan.md by a linear program that
# minimises the worst over-prediction of the total with a bound on under-prediction (a plan should
# err high) and the float32 gradient sums at 1 or more (docs/plan.md gives the errors measured since).
#   acc_layers   the float32 gradient sums of the rank's layers (the clock loop's carry)
#   acc_tables   the float32 gradient sums of the embedding, final norm and head (replicated over pp)
#   scan         the stage's layer-stacked gradient of one backward clock (stages of 2 layers or more)
#   stage_slice  one virtual stage's weights and gradients taken out of the rank's stages (V > 1)
#   stash        (act_slots + 1) stage inputs: the schedule's buffer, every slot allocated
#   stream       one stage input [B/M, T, E] on this device: the residual stream, cotangents, norms
#   stage        what one stage's backward keeps of its layers for one microbatch (per --remat)
#   tables       the embedding table or the head gathered whole over fsdp·sp, float32 (fsdp·sp > 1)
#   weights      one layer's weights or gradient gathered whole over fsdp·sp, float32 (fsdp·sp > 1)
COEFFS = {
    "acc_layers": 1.31,
    "acc_tables": 3.12,
    "scan": 0.75,
    "stage_slice": 3.16,
    "stash": 1.0,
    "stream": 13.03,
    "stage": 0.83,
    "tables": 4.2,
    "weights": 1.51,
}
ACTIVATION_TERMS = ("stash", "stream", "stage")
NAMES = {
    "acc_layers": "float32 gradient sums of the layers",
    "acc_tables": "float32 gradient sums of embedding and head",
    "scan": "stacked layer gradients of a backward clock",
    "stage_slice": "one virtual stage's weights",
    "tables": "embedding and head gathered over fsdp·sp",
    "weights": "one layer's weights or gradient, gathered",
}


@dataclass(frozen=True)
class StageShape:
    """One device's view of a pipelined step: rows per microbatch and the shards it works on."""

    rows: int  # sequences per microbatch (all devices of a stage together)
    seq_len: int
    d_model: int
    split: int  # dp × fsdp × sp: how many ways a stage's devices split a microbatch (rows, then length)
    layers: int  # layers per stage, L / (pp·V)
    act_bytes: int

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch (before the split over the stage's devices)."""
        return self.rows * self.seq_len

    @property
    def slot_bytes(self) -> int:
        """One microbatch's stage input (or its cotangent) on one device: what one ppermute sends."""
        return self.tokens * self.d_model * self.act_bytes // self.split


def stage_shape(job: Job, shape: MeshShape) -> StageShape:
    s = schedule_of(job.pipeline, shape.pp)
    return StageShape(
        job.batch_size // s.microbatches,
        job.seq_len,
        job.cfg.d_model,
        shape.data * shape.sp,
        job.cfg.n_layers // (shape.pp * s.virtual),
        job.act_bytes,
    )


def in_stage_local(job: Job, shape: MeshShape) -> Local:
    """`Local` for per-token counts inside a stage: tp splits heads and MLP; attention is not a ring."""
    return job.local(dataclasses.replace(shape, sp=1, pp=1))


def memory_terms(job: Job, shape: MeshShape) -> dict[str, int]:
    """Sizes in bytes per device of each `COEFFS` term on this pipelined mesh."""
    s = schedule_of(job.pipeline, shape.pp)
    st = stage_shape(job, shape)
    loc = in_stage_local(job, shape)
    state = state_bytes(job.cfg, param_dtype=job.policy.param_dtype)
    sizes = shape.as_dict()
    stacked = [leaf for leaf in state.params if leaf.logical and "layers" in leaf.logical]
    layers = 4 * sum(local_elements(leaf, sizes, state.strategy) for leaf in stacked)
    tables = 4 * (state.params_bytes(shape) // job.param_bytes) - layers
    a, n, split = job.act_bytes, st.tokens, st.split
    gathered = shape.fsdp * shape.sp > 1
    return {
        "acc_layers": layers,
        "acc_tables": tables,
        "scan": layers if st.layers > 1 else 0,
        "stage_slice": layers // s.virtual if s.virtual > 1 else 0,
        "stash": (s.act_slots + 1) * st.slot_bytes,
        "stream": st.slot_bytes,
        "stage": st.layers * n * saved_per_token_layer(loc, job.policy.remat) * a // split,
        "tables": loc.w_table * 4 if gathered else 0,
        "weights": loc.w_layer * 4 if gathered else 0,
    }


def estimate(job: Job, shape: MeshShape) -> MemoryPie:
    """The memory pie of one device (every rank allocates the same buffers) on a pipelined mesh."""
    state = state_bytes(job.cfg, param_dtype=job.policy.param_dtype)
    params, grads, opt = state.params_bytes(shape), state.grads_bytes(shape), state.optimizer_bytes(shape)
    live = {k: int(COEFFS[k] * v) for k, v in memory_terms(job, shape).items()}
    activations = sum(live[k] for k in ACTIVATION_TERMS)
    detail = {NAMES[k]: v for k, v in live.items() if k not in ACTIVATION_TERMS and v}
    detail["less the gradients (a slice of the pie)"] = -grads
    detail["batch"] = BATCH_FIELDS * 4 * job.batch_size * job.seq_len // (shape.data * shape.sp)
    return MemoryPie(params, grads, opt, activations, max(0, sum(detail.values())), detail)


# -------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Stage:
    """One pp rank: the layers it holds, what it keeps in flight, and its memory."""

    rank: int
    layers: list[tuple[int, int]]
    in_flight: int  # stash slots this rank fills at its busiest
    memory_bytes: int  # what the rank allocates (the same on every rank: one program)
    needs_bytes: int  # what it would need with a stash of its own in-flight size

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "layers": [list(r) for r in self.layers],
            "in_flight_microbatches": self.in_flight,
            "memory_bytes": self.memory_bytes,
            "memory_bytes_own_stash": self.needs_bytes,
        }


@dataclass
class PipelinePlan:
    """The pipeline figures of one pp plan."""

    schedule: Schedule
    stages: list[Stage]
    slot_bytes: int
    forward_clocks: int
    backward_clocks: int
    forward_clock_s: float = 0.0  # predicted seconds of one clock's forward work on every rank
    backward_clock_s: float = 0.0
    transfer_s: float = 0.0  # per step, on the link between stages
    link: str = ""

    @property
    def pp(self) -> int:
        return self.schedule.pp

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    @property
    def transfer_bytes(self) -> int:
        """Bytes each device sends to its neighbour stage per step (activations and cotangents)."""
        return (self.forward_clocks + self.backward_clocks) * self.slot_bytes

    @property
    def bubble(self) -> float:
        """The schedule's idle share with the predicted forward and backward clock times."""
        v = self.schedule.virtual
        if self.forward_clock_s <= 0 or self.backward_clock_s <= 0:
            return self.schedule.bubble()
        return self.schedule.bubble(v * self.forward_clock_s, v * self.backward_clock_s)

    @property
    def worst(self) -> Stage:
        return max(self.stages, key=lambda st: (st.needs_bytes, -st.rank))

    def as_dict(self) -> dict:
        s = self.schedule
        return {
            "pp": s.pp,
            "schedule": s.name,
            "microbatches": s.microbatches,
            "virtual_stages": s.virtual,
            "clocks": s.clocks,
            "forward_clocks": self.forward_clocks,
            "backward_clocks": self.backward_clocks,
            "bubble": self.bubble,
            "bubble_schedule": s.bubble(),
            "bubble_theoretical": s.theoretical_bubble(),
            "stash_slots": s.act_slots,
            "cotangent_slots": s.cot_slots,
            "transfer_bytes_per_device_per_step": self.transfer_bytes,
            "transfer_bytes_per_message": self.slot_bytes,
            "transfer_seconds": self.transfer_s,
            "transfer_link": self.link,
            "worst_stage": self.worst.rank,
            "stages": [st.as_dict() for st in self.stages],
            "embedding_and_head": "replicated on every stage; every rank runs the head in each backward clock",
        }


def plan_pipeline(job: Job, shape: MeshShape, pie: MemoryPie) -> PipelinePlan:
    """Schedule, per-stage figures and transfers of a pp plan (times are filled by the cost model)."""
    s = schedule_of(job.pipeline, shape.pp)
    st = stage_shape(job, shape)
    fwd, bwd = clock_counts(s)
    stash_each = int(COEFFS["stash"] * st.slot_bytes)
    stages = []
    for r, flight in enumerate(in_flight_per_rank(s)):
        own = pie.total - (s.act_slots - flight) * stash_each
        stages.append(Stage(r, stage_layers(job.cfg.n_layers, s, r), flight, pie.total, own))
    return PipelinePlan(s, stages, st.slot_bytes, fwd, bwd)


# ------------------------------------------------------------------------------ collectives, time


def collectives(job: Job, shape: MeshShape) -> list[comms.Collective]:
    """The collectives of one pipelined step, per device.

    Exact: the stage transfers (one ppermute of a stage input per forward clock, one of a cotangent
    per backward clock) and the sums over pp of the replicated tables' float32 gradients and the loss.
    Estimated, per clock: every rank runs its layers on its share of one microbatch each clock, so the
    collectives of a step without a pipeline repeat per clock: tp's all-reduces per forward clock
    (attention out, MLP down, the embedding lookup) and per backward clock (the recomputed forward's,
    the input gradients of q, k, v, gate and up, the head's); the ring's k, v passes over sp; with
    fsdp·sp > 1 the stage's layer weights are all-gathered each clock (twice in a backward clock: the
    recomputation and the backward) and their gradients reduce-scattered in each backward clock; the
    data axes sum the gradients of each backward clock.
    """
    s = schedule_of(job.pipeline, shape.pp)
    st = stage_shape(job, shape)
    loc = in_stage_local(job, shape)
    fwd, bwd = clock_counts(s)
    a, p, E, Ls = job.act_bytes, job.param_bytes, job.cfg.d_model, st.layers
    n = st.tokens // st.split  # tokens of a microbatch on one device
    out = comms.Collectives(shape)
    add = out.add

    add("collective-permute", ("pp",), st.slot_bytes, fwd, "pipeline", "pp: stage input to the next stage", False)
    add("collective-permute", ("pp",), st.slot_bytes, bwd, "pipeline", "pp: cotangent to the previous stage", False)
    terms = memory_terms(job, shape)
    add("all-reduce", ("pp",), terms["acc_tables"] + 4, 1, "pipeline", "pp: sum the tables' gradients and the loss")
    if s.virtual > 1:  # rank r stores layers r·L/pp .. but runs stages r, r + pp, ...
        add(
            "all-to-all",
            ("pp",),
            2 * terms["acc_layers"] // 4 * p,
            1,
            "pipeline",
            "pp: layers to their virtual stages, and their gradients back",
        )
    stream = n * E * a
    recompute = 1 if job.policy.remat != "none" else 0
    clocks_fwd = fwd + bwd * (1 + recompute)  # forward passes of the stage: forward clocks, recomputations
    add("all-reduce", ("tp",), stream, Ls * clocks_fwd, "attn.out", "tp: sum partial outputs", False)
    add("all-reduce", ("tp",), stream, Ls * clocks_fwd, "mlp.down", "tp: sum partial outputs", False)
    add("all-reduce", ("tp",), 3 * stream, Ls * bwd, "attn.qkv", "tp: input gradients of q, k, v", False)
    add("all-reduce", ("tp",), 2 * stream, Ls * bwd, "mlp.in", "tp: input gradients of gate, up", False)
    add("all-reduce", ("tp",), stream, fwd + 2 * bwd, "embed", "tp: embedding lookup from vocab shards", False)
    add("all-reduce", ("tp",), stream, bwd, "lm_head", "tp: input gradient of the head (every backward clock)", False)
    add("all-reduce", ("tp",), 3 * n * 4, bwd, "loss", "tp: softmax statistics over vocab shards", False)
    if shape.sp > 1:  # RingAttention, as `meshlm.plan.comms.predict` counts it, per clock
        _ring_per_clock(add, job, loc, n, shape.sp, Ls * clocks_fwd, Ls * bwd)
    _stage_weights_and_tables(add, shape, loc, p, Ls, fwd, bwd, s.virtual)
    return list(out)


def _ring_per_clock(add, job: Job, loc: Local, n: int, hops: int, layer_fwds: int, layer_bwds: int) -> None:
    """RingAttention's sends over sp for `collectives`: n tokens per device, `layer_fwds` forward and
    `layer_bwds` backward passes of a layer per step."""
    a = job.act_bytes
    kv, kv32, ids = (
        n * loc.kv_heads * job.cfg.head_dim * a,
        n * loc.kv_heads * job.cfg.head_dim * 4,
        n * 4,
    )
    add("collective-permute", ("sp",), 2 * kv, hops * layer_fwds, "attention", "ring: pass k, v (forward)")
    add(
        "collective-permute",
        ("sp",),
        2 * kv + 2 * ids + 2 * kv32,
        hops * layer_bwds,
        "attention",
        "ring: pass k, v, ids and dk, dv accumulators (backward)",
    )
    add("collective-permute", ("sp",), 2 * kv32, layer_bwds, "attention", "ring: send dk, dv home")


def _stage_weights_and_tables(
    add, shape: MeshShape, loc: Local, p: int, Ls: int, fwd: int, bwd: int, virtual: int
) -> None:
    """For `collectives`: fsdp's gathers and reduce-scatters and dp's sums of the stage's layer weights
    (Ls layers, fwd and bwd clocks, `virtual` stages per rank), and the embedding table's and head's."""
    F = ("fsdp", "sp")
    for op, w in (
        ("attn.qkv", loc.w_qkv),
        ("attn.out", loc.w_out),
        ("mlp.in", loc.w_mlp_in),
        ("mlp.down", loc.w_mlp_out),
    ):
        if shape.fsdp * shape.sp > 1:
            add("all-gather", F, w * p, Ls * (fwd + 2 * bwd), op, "fsdp: gather the stage's weights each clock")
            add("reduce-scatter", F, w * p, Ls * bwd, op, "fsdp: reduce-scatter weight gradients each backward clock")
        if Ls > 1:  # inside the stage's layer loop, each backward clock
            add("all-reduce", ("dp",), w * p / (shape.fsdp * shape.sp), Ls * bwd, op, "dp: sum weight gradients")
        else:  # a stage of one layer: XLA sums the accumulated gradients once, after the clocks
            add("all-reduce", ("dp",), w * p / (shape.fsdp * shape.sp) * virtual, 1, op, "dp: sum weight gradients")
    add("all-gather", F, loc.w_table * p, 2, "embed", "fsdp: gather the embedding table and head")
    add(
        "all-reduce",
        ("dp", "fsdp", "sp"),
        2 * loc.w_table * p,
        bwd,
        "embed",
        "sum the tables' gradients over the data axes",
    )


def operator_flops(job: Job, shape: MeshShape) -> dict[str, float]:
    """FLOPs per device per step of each operator of a pipelined step.

    Each clock every rank runs its stage (L/(pp·V) layers) on one microbatch, split over the stage's
    devices as a step without a pipeline splits its batch (rows over dp·fsdp, length over sp, heads and
    MLP over tp); forward clocks run it once, backward clocks three times (the recomputed forward and
    the backward), four with a `--remat` policy inside the stage; each backward clock also runs the
    head (forward and backward) on every rank."""
    s = schedule_of(job.pipeline, shape.pp)
    st = stage_shape(job, shape)
    fwd, bwd = clock_counts(s)
    loc = in_stage_local(job, shape)
    n = st.tokens / st.split
    back = 3 + (1 if job.policy.remat != "none" else 0)
    out = {name: f / loc.tokens * n * st.layers * (fwd + back * bwd) for name, f in cost.matmul_flops(loc).items()}
    out["lm_head"] = 3 * 2 * n * loc.w_table * bwd
    return out


def operator_table(
    job: Job, shape: MeshShape, hw: Hardware, collectives: list[comms.Collective]
) -> list[cost.Operator]:
    """The rated operator table of a pipelined step: the rows of `meshlm.plan.cost` with the FLOPs of
    `operator_flops`, and a row for the stage transfers."""
    flops = operator_flops(job, shape)
    # Every operator the cost table leaves without FLOPs (the layers') is counted in `flops`.
    rows = {name: (text, cast(float, flops.get(name, f))) for name, (text, f) in cost.operator_rows(job, shape).items()}
    s = schedule_of(job.pipeline, shape.pp)
    x = cost.notation(axes.STREAM, DEFAULT.activations, shape)
    rows["pipeline"] = (
        f"{x} → next stage, its cotangent → previous ({s.name}, {s.microbatches} microbatches"
        f" of {job.batch_size // s.microbatches} rows, ring over pp)",
        0.0,
    )
    fwd, bwd = clock_counts(s)
    # Attention's ring loops: once per forward clock; the recomputed forward and the backward (and the
    # stage's remat policy once more) per backward clock.
    loops = stage_shape(job, shape).layers * (fwd + (2 + (job.policy.remat != "none")) * bwd)
    return cost.rated_operators(rows, job, shape, hw, collectives, ring_loops=loops)


def elementwise_bytes(job: Job, shape: MeshShape) -> float:
    """Bytes the non-matmul work of a pipelined step streams per device: one stage's activations on its
    share of a microbatch once per forward clock and three times per backward clock (every rank)."""
    s = schedule_of(job.pipeline, shape.pp)
    st = stage_shape(job, shape)
    fwd, bwd = clock_counts(s)
    per_clock = (
        st.layers * st.tokens // st.split * saved_per_token_layer(in_stage_local(job, shape), "none") * job.act_bytes
    )
    return per_clock * (fwd + 3 * bwd)


def clock_seconds(job: Job, shape: MeshShape, ops: list[cost.Operator], hw: Hardware) -> tuple[float, float]:
    """(forward clock, backward clock) compute seconds on every rank, from the operator table's step
    totals split over the clocks in proportion to their work."""
    s = schedule_of(job.pipeline, shape.pp)
    fwd, bwd = clock_counts(s)
    back = 3 + (1 if job.policy.remat != "none" else 0)
    layers = sum(op.compute_s for op in ops if op.name not in ("lm_head", "pipeline"))
    head = sum(op.compute_s for op in ops if op.name == "lm_head")
    share = elementwise_bytes(job, shape) / hw.hbm_bandwidth
    unit = (layers + share) / (fwd + back * bwd)  # one stage forward on one microbatch
    return unit, back * unit + head / max(bwd, 1)


def pp_candidates(n_devices: int, n_layers: int, virtual: int = 1) -> list[int]:
    """Pipeline sizes worth trying: divisors of the device count that split the layers evenly."""
    return [p for p in range(2, n_devices + 1) if n_devices % p == 0 and n_layers % (p * virtual) == 0]
