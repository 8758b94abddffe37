"""Per-device memory of one train step on one mesh: the memory pie.

    params + optimizer     exact (`meshlm.plan.state_bytes`): the train state, donated and updated in place
    gradients              exact: one gradient per parameter, sharded like it
    activations            what the backward pass keeps from the forward pass, for every layer
    temporaries            everything live only for a while: logits and their gradient, the gathered
                           embedding table and head, one layer's working set in the backward pass,
                           fsdp-gathered weights, the input batch

Activations. Per token and layer (elements; E d_model, Hl / Kl heads / kv heads on this device,
D head_dim, Ml this device's MLP width, T the attention span of one query), what the compiled
program of meshlm's layer stacks for the backward pass under each `--remat` policy:

    none           6E + 6Ml + 2·Hl·D + 2·Kl·D (+ 2·Hl·T + 3·Hl for dense attention's scores) + 4
    save_dots      2E + 2Ml + Hl·D + 2·Kl·D       (matmul outputs: q, k, v, attention out, gate, up)
    save_attn      2E + 2·Hl·D + 2·Kl·D (+ lse)   (save_qkv_attn and the output projection's result)
    save_qkv_attn  E + 2·Hl·D + 2·Kl·D (+ lse)    (the layer input, q, k, v, attention output)
    full           E                               (the layer input only)

where lse is the float32 log-sum-exp per query head that the blockwise and ring kernels keep for
their backward (Hl float32 values; dense attention has none).

Temporaries are what else is live at the peak. The compiled step peaks in one of two places, and
the peak is the larger of the two:

    forward    about where the backward pass starts: embedding table and head with their gradients,
               the residual stream's buffers, one layer's working set, the gradients so far
    backward   deep in the backward pass: the saved activations still to be read, fsdp-gathered
               weights, the logits' gradient, the residual stream's buffers

Each place is a sum of terms (sizes below), each with a coefficient: about how many buffers of that
size XLA's buffer assignment holds there (a fit, so a coefficient below 1 means "partly live"). The
coefficients were fitted once, by a linear program that minimises the worst relative error, to the
compiled peak of (model, mesh, remat, batch, seq_len, grad_accum) cases on simulated CPU devices
(docs/plan.md, "Accuracy", gives the cases and the errors; `bench/plan_accuracy.py` measures them).
They describe XLA:CPU's schedule; other backends schedule differently, so treat the temporaries as an
estimate and the state, gradients and activations as the firm part. Peak memory is the state plus the
batch plus the larger place, the figure `compiled.memory_analysis()` gives as argument + output -
alias + temp bytes.

Meshes without pipeline stages only: `meshlm.plan.pipeline` estimates pp > 1 (on top of this module's
terms), and `meshlm.plan.estimate` picks one or the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.mesh import MeshShape
from meshlm.plan.job import Job, Local
from meshlm.plan.state_bytes import state_bytes

# Buffers of each size live at each of the two places (see the module docstring), fitted to
# XLA:CPU's buffer assignment (docs/plan.md, "Accuracy").
#   logits      float32 [n, V/tp] logits or their gradient
#   tables      [V/tp, E] in param dtype: the gathered embedding table or head, or its gradient
#   lookup      with fsdp·sp > 1, the same size again: the embedding table the lookup no longer gathers (the
#               token ids go to the table, `meshlm.sharding.lookup`), nor sums its gradient whole; its
#               coefficient, negative, takes those buffers off `tables`
#   stream      [n, E] activations: the residual stream, norm outputs and their gradients
#   layer       one layer's tp-sharded activations (policy `none`, less the [n, E] ones)
#   weights     one layer's fsdp-gathered weights (only when fsdp×sp > 1)
#   accum       with gradient accumulation: running gradient sums
#   gradients   the gradients (1.0: all of them live)
#   activations the saved activations (1.0: all of them live)
#   scores      with sp: one ring step's float32 attention scores [rows, Hl, T/sp, T/sp]
#   cast_params this device's parameters (its fsdp shard) in the compute dtype: XLA:TPU casts all of them
#               once, before the layer loop, and gathers the cast shard inside it
# XLA:TPU ("tpu", every TPU generation): both places are fitted by `python bench/plan_tpu.py --fit` to 25
# v5p compiles (5 shapes × the 5 meshes of the table, none of them the table's cases), starting from
# XLA:CPU's with the tables at half (XLA:TPU gathers the head in bfloat16, docs/plan.md) and the hoisted
# cast; XLA:CPU's `lookup` correction is left out (the fit is as good without it).
# v5e and v6e compile the same program with the same buffers; from the same sizes they keep less of a
# small program's temporaries in HBM (docs/plan.md, "Accuracy on TPU"). GPUs and pipelines keep XLA:CPU's.
PLACES = {
    "cpu": {
        "forward": {"tables": 3.98, "lookup": -2.0, "stream": 7.88, "layer": 1.09, "accum": 2.23, "gradients": 1.10,
                    "activations": 0.51},
        "backward": {"logits": 1.53, "lookup": -1.28, "stream": 11.71, "weights": 3.28, "accum": 2.06, "gradients": 0.39,
                     "activations": 1.10},
    },
    "tpu": {
        "forward": {"tables": 2.0, "stream": 7.88, "layer": 1.09, "accum": 2.23, "gradients": 0.90, "activations": 0.51,
                    "cast_params": 1.0},
        "backward": {"logits": 0.56, "stream": 7.62, "layer": 1.0, "weights": 3.28, "accum": 2.06, "gradients": 0.21,
                     "activations": 2.21, "scores": 4.47, "cast_params": 0.0},
    },
}


def compiler_for(hardware: str) -> str:
    """The `PLACES` entry for a hardware catalog name (`tpu-v5p`) or a JAX device kind (`TPU v5 lite`):
    the compiler whose buffer assignment was fitted. TPUs get XLA:TPU's; GPUs get XLA:CPU's."""
    return "tpu" if hardware.strip().lower().startswith("tpu") else "cpu"


BATCH_FIELDS = 5  # inputs, targets, positions, segment_ids, loss_mask: 4 bytes per token each


def saved_per_token_layer(loc: Local, remat: str) -> int:
    """Elements one layer keeps per token for the backward pass under this remat policy."""
    c = loc.cfg
    E, Ml, Hl, Kl, D = c.d_model, loc.mlp, loc.heads, loc.kv_heads, c.head_dim
    if remat == "full":
        return E
    if remat == "save_dots":
        return 2 * E + 2 * Ml + Hl * D + 2 * Kl * D
    if remat in ("save_qkv_attn", "save_attn"):
        lse = 0 if loc.attention == "dense" else Hl * 4 // loc.job.act_bytes  # float32, in activation elements
        return (2 if remat == "save_attn" else 1) * E + 2 * Hl * D + 2 * Kl * D + lse
    scores = 2 * Hl * loc.job.seq_len + 3 * Hl if loc.attention == "dense" else 0
    return 6 * E + 6 * Ml + 2 * Hl * D + 2 * Kl * D + scores + 4


@dataclass(frozen=True)
class MemoryPie:
    """Bytes per device. `temporaries_detail` names the parts of `temporaries`."""

    params: int
    gradients: int
    optimizer: int
    activations: int
    temporaries: int
    temporaries_detail: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.activations + self.temporaries

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "temporaries": self.temporaries, "total": self.total}


def terms(job: Job, shape: MeshShape) -> tuple[dict[str, int], dict[str, int]]:
    """The memory pie's inputs on one device: the exact parts (params, gradients, optimizer, activations,
    batch) and the size of one buffer of each `PLACES` term."""
    loc = job.local(shape)
    cfg = job.cfg
    state = state_bytes(cfg)
    a, p, n = job.act_bytes, job.param_bytes, loc.tokens
    grads = state.grads_bytes(shape)
    activations = cfg.n_layers * n * saved_per_token_layer(loc, cfg.remat) * a
    fsdp = shape.fsdp * shape.sp > 1
    stream = n * cfg.d_model * a
    exact = {"params": state.params_bytes(shape), "gradients": grads, "optimizer": state.optimizer_bytes(shape),
             "activations": activations, "batch": BATCH_FIELDS * 4 * n * job.grad_accum}
    sizes = {
        "logits": n * loc.vocab * 4,
        "tables": loc.w_table * p,
        "lookup": loc.w_table * p if fsdp else 0,
        "stream": stream,
        "layer": n * saved_per_token_layer(loc, "none") * a - 6 * stream,
        "weights": loc.w_layer * p if fsdp else 0,
        "accum": grads if job.grad_accum > 1 else 0,
        "gradients": grads,
        "activations": activations,
        "scores": loc.rows * loc.heads * loc.length ** 2 * 4 if shape.sp > 1 else 0,
        "cast_params": exact["params"] * a // p,
    }
    return exact, sizes


def estimate(job: Job, shape: MeshShape, compiler: str = "cpu") -> MemoryPie:
    """The memory pie of one device on a mesh without pipeline stages, with the temporaries of `compiler`
    (a key of `PLACES`; `compiler_for(hardware)` picks it)."""
    exact, sizes = terms(job, shape)
    grads, activations = exact["gradients"], exact["activations"]
    live = {place: {k: int(c * sizes[k]) for k, c in coeffs.items()} for place, coeffs in PLACES[compiler].items()}
    place = max(live, key=lambda name: sum(live[name].values()))
    # Temporaries: the place's buffers, less the gradients and activations counted in the pie.
    detail = {f"{k} ({place} pass)": v for k, v in live[place].items() if k not in ("gradients", "activations") and v}
    detail["gradients and activations not live at the peak"] = live[place]["gradients"] + live[place]["activations"] - grads - activations
    detail["batch"] = exact["batch"]
    return MemoryPie(exact["params"], grads, exact["optimizer"], activations, max(0, sum(detail.values())), detail)
