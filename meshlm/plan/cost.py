"""The operator table and the step-time model.

Each large operator of a step is written in sharding notation, MaxText style, from the `default`
strategy's tables, e.g. on mesh dp=2, fsdp=4, tp=2

    attn.out   B_dp,fsdp T H_tp D @ H_tp D E_fsdp = B_dp,fsdp T E  → all-reduce over tp

with its arithmetic intensity on each link (FLOPs / bytes sent). The step time is a roofline with
overlap: compute (matmuls at peak, HBM-bound work at bandwidth) plus the exposed communication (tp
all-reduces, and what fsdp, dp and ring traffic does not hide behind compute; nothing overlaps on
simulated CPU devices). `meshlm.plan.pipeline` rates its per-clock rows with `rated_operators`.
docs/plan.md, "The operator table and the step-time model", has the worked example.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm import sharding
from meshlm.flops import mean_attended_keys, model_flops_per_token
from meshlm.mesh import MeshShape
from meshlm.plan import comms
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job, Local
from meshlm.plan.memory import saved_per_token_layer
from meshlm.plan.state_bytes import abstract_mesh
from meshlm.strategy import DEFAULT

_LETTER = {
    "batch": "B",
    "length": "T",
    "embed": "E",
    "heads": "H",
    "kv_heads": "K",
    "head_dim": "D",
    "mlp": "M",
    "vocab": "V",
    "layers": "L",
}
# Forward-pass matmuls are recomputed in the backward pass under these policies (per operator group).
_RECOMPUTED = {
    "full": {"attn.qkv", "attention", "attn.out", "mlp.in", "mlp.down"},
    "save_dots": {"attention"},
    "save_qkv_attn": {"attn.out", "mlp.in", "mlp.down"},
    "save_attn": {"mlp.in", "mlp.down"},
    "none": set(),
}


def notation(logical: tuple, table, shape: MeshShape) -> str:
    """`B_dp,fsdp T E` for logical axes ('batch', 'length', 'embed') on this mesh."""
    spec = sharding.logical_to_spec(logical, table, abstract_mesh(shape))
    out = []
    for name, entry in zip(logical, tuple(spec) + (None,) * (len(logical) - len(spec))):
        letter = _LETTER[name] if name else "?"
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(letter + ("_" + ",".join(axes) if axes else ""))
    return " ".join(out)


@dataclass
class Operator:
    """One row of the operator table: per device, per step (all layers, forward and backward)."""

    name: str
    notation: str
    flops: float
    collectives: list[comms.Collective] = field(default_factory=list)
    compute_s: float = 0.0
    comm_s: float = 0.0
    intensity: float | None = None  # FLOPs per byte on its busiest link; None without communication
    ridge: float | None = None  # the hardware's intensity on that link
    link: str = ""
    fix: str = ""

    @property
    def comm_bound(self) -> bool:
        return self.intensity is not None and self.ridge is not None and self.intensity < self.ridge


def matmul_flops(loc: Local) -> dict[str, float]:
    """Forward FLOPs per device per micro-batch of each operator group (2 per multiply-add); attention's
    counts the keys each query attends (`mean_attended_keys`: local layers only their window)."""
    n, c = loc.tokens, loc.cfg
    return {
        "attn.qkv": 2 * n * loc.w_qkv,
        "attention": 2 * 2 * n * mean_attended_keys(c, loc.job.seq_len) * loc.heads * c.head_dim,
        "attn.out": 2 * n * loc.w_out,
        "mlp.in": 2 * n * loc.w_mlp_in,
        "mlp.down": 2 * n * loc.w_mlp_out,
    }


def operator_rows(job: Job, shape: MeshShape) -> dict[str, tuple[str, float | None]]:
    """The operator table's rows: name -> (sharding notation, FLOPs per device per step), the FLOPs left
    None for the layers' operators, whose count depends on how the step runs them."""
    loc = job.local(shape)
    A = job.grad_accum
    acts, params = DEFAULT.activations, DEFAULT.params

    def nt(kind, *logical):
        return notation(tuple(logical), acts if kind == "a" else params, shape)

    x = nt("a", "batch", "length", "embed")
    return {
        "embed": (f"lookup {nt('p', 'vocab', 'embed')} → {nt('a', 'vocab', 'embed')}: {x}", 0.0),
        "attn.qkv": (
            f"{x} @ {nt('p', 'embed', 'heads', 'head_dim')} = {nt('a', 'batch', 'length', 'heads', 'head_dim')} (and k, v)",
            None,
        ),
        "attention": (
            f"{nt('a', 'batch', 'length', 'heads', 'head_dim')} @ {nt('a', 'batch', 'length', 'kv_heads', 'head_dim')}ᵀ"
            + (" (ring over sp)" if shape.sp > 1 else ""),
            None,
        ),
        "attn.out": (
            f"{nt('a', 'batch', 'length', 'heads', 'head_dim')} @ {nt('p', 'heads', 'head_dim', 'embed')} = {x}",
            None,
        ),
        "mlp.in": (f"{x} @ {nt('p', 'embed', 'mlp')} = {nt('a', 'batch', 'length', 'mlp')} (gate, up)", None),
        "mlp.down": (f"{nt('a', 'batch', 'length', 'mlp')} @ {nt('p', 'mlp', 'embed')} = {x}", None),
        "lm_head": (
            f"{x} @ {nt('p', 'embed', 'vocab')} = {nt('a', 'batch', 'length', 'vocab')}",
            2 * loc.tokens * loc.w_table * 3 * A,
        ),
        "loss": (f"softmax over {nt('a', 'batch', 'length', 'vocab')}", 0.0),
        "norms": (f"RMSNorm {nt('p', 'embed')}", 0.0),
    }


def operator_table(job: Job, shape: MeshShape, hw: Hardware, collectives: list[comms.Collective]) -> list[Operator]:
    """The rated operator table of a step without pipeline stages: each layer operator runs forward and
    backward (3×) plus its recomputation, in every layer and micro-batch."""
    loc = job.local(shape)
    L, A = job.cfg.n_layers, job.grad_accum
    fwd = matmul_flops(loc)
    recomputed = _RECOMPUTED.get(job.policy.remat, set())
    rows = {
        name: (text, fwd[name] * (3 + (name in recomputed)) * L * A if flops is None else flops)
        for name, (text, flops) in operator_rows(job, shape).items()
    }
    # Attention runs forward, backward, and again forward where the policy recomputes it.
    return rated_operators(rows, job, shape, hw, collectives, ring_loops=(2 + ("attention" in recomputed)) * L * A)


# The operators that are one [tokens, in] @ [in, out] matmul per device (and its two backward matmuls):
# they run at the hardware's measured efficiency for the device's rows (`Hardware.matmul_efficiency`).
ROW_MATMULS = ("attn.qkv", "attn.out", "mlp.in", "mlp.down", "lm_head")


def rated_operators(
    rows: dict[str, tuple[str, float]],
    job: Job,
    shape: MeshShape,
    hw: Hardware,
    collectives: list[comms.Collective],
    ring_loops: float = 0,
) -> list[Operator]:
    """One `Operator` per row (name -> (notation, FLOPs)) with its collectives, times and intensity.

    Matmuls run at the hardware's efficiency for the device's rows, attention at its kernel's
    (`Hardware.attention_efficiency`); with sp, attention also pays the
    hardware's `ring_step_s` for each of the sp steps of each of its `ring_loops` ring loops per step."""
    loc = job.local(shape)
    ops = []
    for name, (text, flops) in rows.items():
        op = Operator(name, text, flops, [c for c in collectives if c.op == name])
        op.compute_s = flops / hw.peak_flops(job.policy.dtype)
        if name in ROW_MATMULS:
            op.compute_s /= hw.matmul_efficiency(loc.tokens)
        if name == "attention":
            op.compute_s /= hw.attention_efficiency
        if name == "attention" and shape.sp > 1:
            op.compute_s += hw.ring_step_s * shape.sp * ring_loops
        _rate(op, shape, hw, loc)
        ops.append(op)
    return ops


def _rate(op: Operator, shape: MeshShape, hw: Hardware, loc: Local) -> None:
    """Times, intensity on the busiest link, and what to change when communication dominates."""
    if not op.collectives:
        return
    op.comm_s = sum(comms.wire_seconds(c, shape, hw) for c in op.collectives)
    per_link: dict[str, float] = {}
    for c in op.collectives:
        for link, sent in comms.link_bytes(c, shape, hw).items():
            per_link[link] = per_link.get(link, 0.0) + sent
    bandwidth = {"fast": hw.fast_bandwidth, "slow": hw.slow_bandwidth}
    link = max(per_link, key=lambda k: per_link[k] / bandwidth[k])
    op.link = hw.slow_name if link == "slow" else hw.fast_name
    op.ridge = hw.peak_flops(loc.policy.dtype) / bandwidth[link]
    if op.flops > 0:
        op.intensity = op.flops / per_link[link]
        if op.intensity < op.ridge:
            users = [c for c in op.collectives if link in comms.link_bytes(c, shape, hw)]
            op.fix = _fix(op, users, loc, shape)


def _fix(op: Operator, cs: list[comms.Collective], loc: Local, shape: MeshShape) -> str:
    axes = {a for c in cs for a in c.axes}
    if "tp" in axes and not axes & {"fsdp", "dp"}:
        return f"less tp (intensity falls as tp grows: M/tp = {loc.cfg.mlp_dim // shape.tp}); move devices to fsdp"
    if "sp" in axes and op.name == "attention":
        return f"less sp or a longer sequence per device (now {loc.length} tokens)"
    if axes & {"fsdp", "sp"}:
        return f"more tokens per device (now {loc.tokens}: raise batch_size or seq_len), or less fsdp across hosts"
    if "pp" in axes:
        return "more rows per microbatch (fewer --microbatches) or fewer pipeline stages"
    if "dp" in axes:
        return "fsdp instead of dp (reduce-scatter sends half of an all-reduce) or more tokens per device"
    return "fewer devices on this axis"


def row_parallel_intensity(rows: int, m_shard: int, e: int, dtype_bytes: int = 2, all_reduce: bool = False) -> float:
    """FLOPs per byte sent of one row-parallel matmul `B M_x @ M_x E = B E`, reduce-scattered over x.

    The sharding guide's worked example: 2·B·M_x·E FLOPs against B·E·dtype_bytes sent (twice that
    for an all-reduce), so in bfloat16 the intensity is M_x whatever B and E are.
    """
    return 2 * rows * m_shard * e / (rows * e * dtype_bytes * (2 if all_reduce else 1))


def min_compute_bound_shard(hw: Hardware, dtype: str = "bfloat16", all_reduce: bool = False) -> int:
    """The smallest M_x for which that matmul is compute-bound on the hardware's fast link."""
    ridge = hw.peak_flops(dtype) / hw.fast_bandwidth
    nbytes = 4 if str(dtype) == "float32" else 2
    m = max(1, int(ridge * nbytes * (2 if all_reduce else 1) / 2))
    while row_parallel_intensity(1, m, 1, nbytes, all_reduce) < ridge:
        m += 1
    return m


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    memory_s: float  # HBM-bound part of compute_s
    comm_s: float  # all collective time
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    mfu: float


# How often each byte an activation saved for the backward is streamed: written in the forward and read
# in the backward; on XLA:CPU also zero-filled and copied once more (the layer loop's stacked outputs
# start as broadcast zeros, and the compiled program copies them before the backward reads them).
RESIDUAL_PASSES = {"cpu": 4, "gpu": 2, "tpu": 2}


def elementwise_bytes(job: Job, shape: MeshShape, backend: str) -> float:
    """Bytes the non-matmul work of a step without pipeline stages streams per device: each activation
    about three times (forward, backward, recompute), and the activations the remat policy saves for
    the backward `RESIDUAL_PASSES[backend]` times more (so keeping more is not free)."""
    loc = job.local(shape)
    per_token = 3 * saved_per_token_layer(loc, "none") + RESIDUAL_PASSES[backend] * saved_per_token_layer(
        loc, job.policy.remat
    )
    return job.cfg.n_layers * job.grad_accum * loc.tokens * per_token * job.act_bytes


def step_time(
    job: Job,
    shape: MeshShape,
    hw: Hardware,
    ops: list[Operator],
    collectives: list[comms.Collective],
    params_bytes: int,
    elementwise: float,
) -> StepTime:
    """The step's time from its operators, its collectives and `elementwise`, the bytes its non-matmul
    work streams (`elementwise_bytes`, or the pipeline's); the optimizer reads parameter, gradient and
    both moments and writes three of them back."""
    optimizer = 7 * params_bytes
    memory_s = (elementwise + optimizer) / hw.hbm_bandwidth
    compute_s = sum(op.compute_s for op in ops) + memory_s
    serial = sum(comms.wire_seconds(c, shape, hw) for c in collectives if not c.overlappable)
    background = sum(comms.wire_seconds(c, shape, hw) for c in collectives if c.overlappable)
    if hw.name == "cpu":
        exposed = serial + background
    else:
        exposed = serial + max(0.0, background - compute_s)
    step = compute_s + exposed
    tokens_per_s = job.tokens / step
    mfu = model_flops_per_token(job.cfg, job.seq_len) * tokens_per_s / (job.n_devices * hw.peak_flops(job.policy.dtype))
    return StepTime(compute_s, memory_s, serial + background, exposed, step, tokens_per_s, mfu)
