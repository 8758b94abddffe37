"""The collectives of one train step on one mesh, predicted from the model's shapes, and their time.

Bytes are payload bytes per device, the measure `meshlm.hlo` reads from compiled programs. The
prediction follows what XLA's SPMD partitioner emits for the `default` strategy's tables, per
micro-batch: fsdp's weight gathers and gradient reduce-scatters, tp's all-reduces, the sp ring's
sends, the norm scales' sums, and what each `--remat` policy recomputes; XLA:TPU's differences
(weights cast before the gather, fused tp reductions, regathers from `TPU_REGATHER_FROM` tokens)
are modelled with `backend='tpu'`. `wire_seconds` turns payloads into time on the hardware's links.
Meshes with pipeline stages: `meshlm.plan.pipeline` builds theirs with this module's `Collectives`.
docs/plan.md, "The collectives model", lists every term and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshlm.mesh import AXES, MeshShape
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job, Local

# XLA:TPU gathers q's and one of k/v's weights a third time in the backward pass from about this sequence
# length (always with the ring over sp): seen at 1024 (tiny, 1b, llama2-7b) and at 512 (1b, not tiny),
# never at 256. A scheduling choice of the compiler; one layer's q and k weights either way.
TPU_REGATHER_FROM = 512
RECOMPUTES_ATTN_OUT = ("full", "save_qkv_attn")
RECOMPUTES_RING = ("full", "save_dots")


@dataclass(frozen=True)
class Collective:
    kind: str  # all-gather, reduce-scatter, all-reduce, collective-permute
    axes: tuple[str, ...]  # mesh axes of one group
    payload: float  # bytes per execution
    count: int  # executions per step
    op: str  # the operator it serves (a row of the operator table)
    what: str  # why it is there, for people
    overlappable: bool = True  # False: the next computation waits for it (tp all-reduces)

    @property
    def total(self) -> float:
        return self.payload * self.count

    def group(self, shape: MeshShape) -> int:
        sizes = shape.as_dict()
        return math.prod(sizes[a] for a in self.axes)


class Collectives(list):
    """A step's collectives; `add` leaves out the mesh axes of size 1 and what then moves nothing."""

    def __init__(self, shape: MeshShape):
        super().__init__()
        self.sizes = shape.as_dict()

    def add(self, kind, axes, payload, count, op, what, overlappable=True) -> None:
        axes = tuple(x for x in axes if self.sizes.get(x, 1) > 1)
        if axes and payload > 0 and count > 0:
            self.append(Collective(kind, axes, float(payload), count, op, what, overlappable))


def predict(job: Job, shape: MeshShape, backend: str = "cpu") -> list[Collective]:
    """Every collective of one step on a mesh without pipeline stages (groups of one device are left out).

    `backend` is the compiler's ('cpu', 'gpu', 'tpu'; `Hardware.backend`): XLA:TPU's program differs in
    the ways the module docstring lists; 'gpu' is predicted as 'cpu'."""
    loc = job.local(shape)
    out = Collectives(shape)
    _layer_weights_and_norms(out.add, job, loc, backend)
    _embedding_and_head(out.add, job, loc, backend)
    _tensor_parallel(out.add, job, loc, backend)
    s = shape.as_dict()["sp"]
    if s > 1:  # RingAttention
        _ring(out.add, job, loc.kv_heads, loc.tokens, job.act_bytes, s, backend)

    return list(out)


def _element_bytes(job: Job, backend: str) -> tuple[int, int]:
    """Bytes per element of gathered weights and of reduced gradients (XLA:TPU: the compute dtype's)."""
    a, p = job.act_bytes, job.param_bytes
    return (a, a) if backend == "tpu" else (p, p)


def _layer_weights_and_norms(add, job: Job, loc: Local, backend: str) -> None:
    """fsdp's gathers and reduce-scatters and dp's all-reduces of the layers' weights, and the norm scales'
    gathers and gradient sums, for `predict`."""
    sizes = loc.shape.as_dict()
    L, A, p, E = job.cfg.n_layers, job.grad_accum, job.param_bytes, job.cfg.d_model
    g, r = _element_bytes(job, backend)
    F = ("fsdp", "sp")
    batch_axes = ("dp", "fsdp")
    ways = sizes["fsdp"] * sizes["sp"]  # how many ways the weights' embed dimension is split (F)
    layer_weights = {"attn.qkv": loc.w_qkv, "attn.out": loc.w_out, "mlp.in": loc.w_mlp_in, "mlp.down": loc.w_mlp_out}
    for op, w in layer_weights.items():
        if ways > 1:
            add("all-gather", F, w * g, 2 * L * A, op, "fsdp: gather weights (forward and backward)")
            add("reduce-scatter", F, w * r, L * A, op, "fsdp: reduce-scatter weight gradients")
            add("all-reduce", ("dp",), w * r / ways, L * A, op, "dp: all-reduce gradient shards")
        else:
            add("all-reduce", ("dp",), w * r, L * A, op, "dp: all-reduce weight gradients")
    # Norm scales (and the [embed] biases): gathered like weights, gradients are sums over tokens; the
    # small weights without an embed axis (q/k/v biases, q/k norm scales) are whole on every data rank.
    add("all-gather", F, loc.embed_vectors * E * p, 2 * L * A, "norms", "fsdp: gather norm scales")
    add("all-gather", F, E * p, 2, "norms", "fsdp: gather the final norm scale")
    summed = ((loc.embed_vectors * L + 1) * E + L * loc.w_small) * p
    # XLA:TPU sums over the batch axes and sp in one all-reduce, XLA:CPU in two.
    token_axes = ((*batch_axes, "sp"),) if backend == "tpu" else (batch_axes, ("sp",))
    for axes in token_axes:
        add("all-reduce", axes, summed, A, "norms", "sum norm-scale and bias gradients over tokens")


def _embedding_and_head(add, job: Job, loc: Local, backend: str) -> None:
    """The embedding lookup's collectives (the ids go to the table: `meshlm.sharding.lookup`), the output
    head's and the loss's, for `predict`."""
    sizes = loc.shape.as_dict()
    cfg, A = job.cfg, job.grad_accum
    a, p, n, E = job.act_bytes, job.param_bytes, loc.tokens, cfg.d_model
    g, r = _element_bytes(job, backend)
    F = ("fsdp", "sp")
    ways = sizes["fsdp"] * sizes["sp"]
    table = loc.w_table * p
    add("all-gather", F, n * ways * 4, A, "embed", "fsdp: gather the token ids for the lookup", False)
    add("all-reduce", ("tp",), n * E * a, A, "embed", "tp: assemble looked-up rows from vocab shards", False)
    for axis in F:
        add("all-to-all", (axis,), n * E * a, 2 * A, "embed", "fsdp: looked-up rows to their devices (and back)", False)
    add("all-reduce", ("dp",), loc.w_table * r / ways, A, "embed", "dp: sum embedding-table gradients over tokens")
    # The head (with tied embeddings the table itself, which the lookup does not gather) is gathered whole.
    add(
        "all-gather",
        F,
        loc.w_table * g,
        2 if sizes["tp"] > 1 and backend != "tpu" else 1,
        "lm_head",
        "fsdp: gather the output head",
    )
    if ways > 1:
        add("reduce-scatter", F, table, A, "lm_head", "fsdp: reduce-scatter head gradients")
        add("all-reduce", ("dp",), table / ways, A, "lm_head", "dp: all-reduce gradient shards")
    else:
        add("all-reduce", ("dp",), table, A, "lm_head", "dp: all-reduce head gradients")
    add("all-reduce", ("tp",), n * E * a, A, "lm_head", "tp: input gradient of the vocab-parallel head", False)
    add("all-reduce", ("tp",), 3 * n * 4, A, "loss", "tp: softmax max, sum and target logit over vocab shards", False)


def _tensor_parallel(add, job: Job, loc: Local, backend: str) -> None:
    """Tensor parallelism inside each layer: tp's sums of partial outputs and input gradients (and XLA:TPU's
    regather of q, k weights), for `predict`."""
    sizes = loc.shape.as_dict()
    cfg, L, A = job.cfg, job.cfg.n_layers, job.grad_accum
    a, n, E = job.act_bytes, loc.tokens, cfg.d_model
    g, _ = _element_bytes(job, backend)
    fsdp_on = sizes["fsdp"] * sizes["sp"] > 1
    recompute = 1 if job.policy.remat in RECOMPUTES_ATTN_OUT else 0
    add("all-reduce", ("tp",), n * E * a, (1 + recompute) * L * A, "attn.out", "tp: sum partial outputs", False)
    add("all-reduce", ("tp",), n * E * a, L * A, "mlp.down", "tp: sum partial outputs", False)
    if backend == "tpu" and fsdp_on and (sizes["sp"] > 1 or job.seq_len >= TPU_REGATHER_FROM):
        add(
            "all-gather",
            ("fsdp", "sp"),
            E * (loc.heads + loc.kv_heads) * cfg.head_dim * g,
            L * A,
            "attn.qkv",
            "fsdp: gather q, k weights again for the attention kernel's backward",
        )
    summed = backend == "tpu"  # XLA:TPU adds the partial input gradients up before one all-reduce
    add(
        "all-reduce",
        ("tp",),
        (1 if summed else 3) * n * E * a,
        L * A,
        "attn.qkv",
        "tp: sum input gradients of q, k, v",
        False,
    )
    add(
        "all-reduce",
        ("tp",),
        (1 if summed else 2) * n * E * a,
        L * A,
        "mlp.in",
        "tp: sum input gradients of gate, up",
        False,
    )


def _ring(add, job: Job, kv_heads: int, n: int, a: int, s: int, backend: str) -> None:
    """RingAttention's sends over sp (s > 1) for `predict`: n tokens per device, a bytes per activation."""
    cfg, L, A = job.cfg, job.cfg.n_layers, job.grad_accum
    kv, kv32, ids = n * kv_heads * cfg.head_dim * a, n * kv_heads * cfg.head_dim * 4, n * 4
    rings = 2 if job.policy.remat in RECOMPUTES_RING else 1
    add("collective-permute", ("sp",), 2 * kv, s * L * A * rings, "attention", "ring: pass k, v (forward)")
    add("collective-permute", ("sp",), 2 * ids, s * A, "attention", "ring: pass positions, segment ids (forward)")
    add(
        "collective-permute",
        ("sp",),
        2 * kv + 2 * ids + 2 * kv32,
        s * L * A,
        "attention",
        "ring: pass k, v, ids and dk, dv accumulators (backward)",
    )
    # XLA:TPU casts the accumulators to the compute dtype before their last hop, and the recomputed
    # forward ring sends positions and segment ids again.
    add(
        "collective-permute",
        ("sp",),
        2 * (kv if backend == "tpu" else kv32),
        L * A,
        "attention",
        "ring: send dk, dv home",
    )
    if backend == "tpu":
        add(
            "collective-permute",
            ("sp",),
            2 * ids,
            s * L * A * (rings - 1),
            "attention",
            "ring: pass positions, segment ids (recomputed forward)",
        )


def total_bytes(collectives: list[Collective]) -> dict[str, float]:
    """Payload bytes per step by kind (reduce-scatter counted with all-reduce, as CPU programs show it)."""
    out = {"all-gather": 0.0, "all-reduce": 0.0, "collective-permute": 0.0, "all-to-all": 0.0}
    for c in collectives:
        out["all-reduce" if c.kind == "reduce-scatter" else c.kind] += c.total
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------------------ time


def axis_split(shape: MeshShape, hw: Hardware) -> dict[str, tuple[int, int]]:
    """(devices inside one fast domain, fast domains) along each mesh axis.

    Devices are laid out with the last axis fastest-varying (sp, then tp, fsdp, dp, and pp outermost),
    so the communication-heavy model axes sit inside a server or slice, and data axes and pipeline
    stages span them: with several hosts, pp crosses them first.
    """
    inner = 1
    out = {}
    for axis in reversed(("pp", *AXES) if shape.pp > 1 else AXES):
        size = shape.as_dict()[axis]
        room = max(1, hw.fast_domain // inner)
        fast = math.gcd(size, room)
        out[axis] = (fast, size // fast)
        inner *= size
    return out


def wire_seconds(c: Collective, shape: MeshShape, hw: Hardware) -> float:
    """Seconds one device spends on this collective per step (bandwidth term, ring algorithms).

    all-gather / reduce-scatter move payload·(g-1)/g per device, all-reduce twice that; a group
    spanning fast domains runs hierarchically: the fast part over the fast link, then 1/g_fast of
    the payload over the slow link. A permute sends its payload once, over the slow link if the ring
    leaves the fast domain. Each execution also pays the hardware's `collective_latency` (measured on
    simulated CPU devices, where every collective is a rendezvous of all device threads; 0 elsewhere).
    """
    split = axis_split(shape, hw)
    g_fast = math.prod(split[a][0] for a in c.axes)
    g_slow = math.prod(split[a][1] for a in c.axes)
    if c.kind == "collective-permute":
        seconds = c.payload / (hw.slow_bandwidth if g_slow > 1 else hw.fast_bandwidth)
    else:
        factor = 2.0 if c.kind == "all-reduce" else 1.0
        seconds = factor * (
            c.payload * (g_fast - 1) / g_fast / hw.fast_bandwidth
            + c.payload / g_fast * (g_slow - 1) / g_slow / hw.slow_bandwidth
        )
    return (seconds + hw.collective_latency) * c.count


def link_bytes(c: Collective, shape: MeshShape, hw: Hardware) -> dict[str, float]:
    """Bytes per step this collective puts on each link ('fast', 'slow'), counted as MaxText's guide
    does for arithmetic intensity: the payload, twice for an all-reduce, and on the slow link only the
    1/g_fast share that leaves the fast domain."""
    split = axis_split(shape, hw)
    g_fast = math.prod(split[a][0] for a in c.axes)
    g_slow = math.prod(split[a][1] for a in c.axes)
    sent = c.total * (2.0 if c.kind == "all-reduce" else 1.0)
    out = {}
    if g_fast > 1:
        out["fast"] = sent
    if g_slow > 1:
        out["slow"] = sent if c.kind == "collective-permute" else sent / g_fast
    return out
