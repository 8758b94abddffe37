"""Per-device memory of one train step on one mesh: the memory pie.

    params + optimizer, gradients   exact (`meshlm.plan.state_bytes`)
    activations                     what the backward pass keeps, per `--remat` policy
    temporaries                     what else is live at the step's peak (a fitted estimate)

The peak is the state plus the batch plus the larger of two places (forward end, deep backward),
each a sum of terms with coefficients fitted to XLA:CPU's compiled peaks (`PLACES`, per compiler);
on-chip memory (`Hardware.onchip_bytes`) lowers the HBM part, bounded below by `LOSS_PLACE`.
Meshes without pipeline stages only: `meshlm.plan.pipeline` estimates pp > 1 on top of these terms.
docs/plan.md, "The memory pie", has the per-token formulas, the places and how they were fitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.mesh import MeshShape
from meshlm.plan.hardware import CATALOG, GPU_NAMES
from meshlm.plan.job import Job, Local
from meshlm.plan.state_bytes import state_bytes

GPUS = [CATALOG[name] for name in GPU_NAMES]

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
#   pattern     with a local/global layer pattern, its other layers' working set and weights (`PATTERN_LAYER`)
#   cast_params this device's parameters (its fsdp shard) in the compute dtype: XLA:TPU casts all of them
#               once, before the layer loop, and gathers the cast shard inside it
# XLA:TPU ("tpu", every TPU generation): both places are fitted by `python bench/plan_tpu.py --fit` to 25
# v5p compiles (5 shapes × the 5 meshes of the table, none of them the table's cases), starting from
# XLA:CPU's with the tables at half (XLA:TPU gathers the head in bfloat16, docs/plan.md) and the hoisted
# cast; XLA:CPU's `lookup` correction is left out (the fit is as good without it).
# v5e compiles the same program with the same buffers (docs/plan.md, "Accuracy on TPU", compares them with
# its on-chip memory turned off) and keeps part of them on chip (`onchip_eligible`, `LOSS_PLACE`). GPUs and
# pipelines keep XLA:CPU's.
PLACES = {
    "cpu": {
        "forward": {
            "tables": 3.98,
            "lookup": -2.0,
            "stream": 7.88,
            "layer": 1.09,
            "accum": 2.23,
            "gradients": 1.10,
            "activations": 0.51,
            "pattern": 1.0,
        },
        "backward": {
            "logits": 1.53,
            "lookup": -1.28,
            "stream": 11.71,
            "weights": 3.28,
            "accum": 2.06,
            "gradients": 0.39,
            "activations": 1.10,
            "pattern": 1.0,
        },
    },
    "tpu": {
        "forward": {
            "tables": 2.0,
            "stream": 7.88,
            "layer": 1.09,
            "accum": 2.23,
            "gradients": 0.90,
            "activations": 0.51,
            "cast_params": 1.0,
            "pattern": 1.0,
        },
        "backward": {
            "logits": 0.56,
            "stream": 7.62,
            "layer": 1.0,
            "weights": 3.28,
            "accum": 2.06,
            "gradients": 0.21,
            "activations": 2.21,
            # One ring step's scores: the blockwise kernel runs each query block over only the key blocks
            # its position ranges allow (bounded loops, no conditional per block), and XLA:TPU keeps one
            # step's scores live (docs/plan.md, "Accuracy on TPU").
            "scores": 1.0,
            "cast_params": 0.0,
            "pattern": 1.0,
        },
    },
}


# On TPU v5e (`Hardware.onchip_bytes`) XLA:TPU's memory-space assignment moves into VMEM what the HBM peak
# would hold, up to that size, from the same program (the same `PLACES["tpu"]` sizes): a small working set
# goes on chip whole, a large one fills the allotment and HBM keeps the rest. So each place holds
# `min(onchip, eligible)` less in HBM, eligible being all of its buffers; with sp, only the ring's score
# blocks and the saved activations beyond one copy (the buffers live across the ring's loop stay in HBM).
# docs/plan.md, "Accuracy on TPU", gives the compiled allotments and peaks this rests on.
def onchip_eligible(held: dict[str, int], exact: dict[str, int], shape: MeshShape) -> int:
    """Bytes of one place's buffers (`held`: term -> bytes) that on-chip memory can take from HBM."""
    if shape.sp == 1:
        return sum(held.values())
    return held.get("scores", 0) + max(0, held.get("activations", 0) - exact["activations"])


# The loss place, on hardware with on-chip memory only: a floor under the places above once they have
# moved their buffers on chip, sized by the buffers v5e's step keeps in HBM at the loss. In `small` those
# are the float32 logits (all of them: more than VMEM), the head's float32 gradient and the gathered head,
# and the forward place less its on-chip share is larger. In `tiny` none of them is in HBM: the floor
# stands for its residuals and heap slack, and is a fit (these two sizes bound them on every mesh).
# Fitted by `python bench/plan_tpu.py --fit --hardware=tpu-v5e` to the 25 v5e compiles of the fit set (the
# places above fixed, `onchip_bytes` measured): the smallest coefficients near the best worst error
# (docs/plan.md, "Accuracy on TPU", gives the errors over the fit set).
LOSS_PLACE = {"logits": 0.43, "tables": 0.47}


# XLA:GPU with the layer loop unrolled (`meshlm.models.decoder.scan_unroll`: all layers per iteration, the
# GPU default). Each layer's saved activations are then buffers of their own, freed as soon as the
# backward pass has read them, and each layer's weight gradients are made only when the backward pass
# reaches it; a scanned loop instead keeps the stacked activations until the loop ends and allocates
# the stacked gradients before it starts (the `gradients` and `activations` terms of both `PLACES`).
# Counting every gradient beside every activation double counts the layers' share: unrolled, the
# backward pass trades one for the other, layer by layer. Its peak is at one end of that walk:
#   start  every saved activation, the last layer's weight gradients and the head's (the loss makes it in
#          the forward pass, `meshlm.models.loss`), beside the first layer's working set
#   end    every gradient (the embedding's is made last), the first layer's activations, the working set
# The working set keeps XLA:CPU's coefficients (the larger of its two places). docs/plan.md, "Where the
# hardware numbers come from", compares the prediction with an H200's compiled peak.
UNROLLED_WORKING_SET = {"stream": 11.71, "layer": 1.09, "weights": 3.28, "accum": 2.23}


def unrolled_on_gpu(job: Job, compiler: str) -> bool:
    """Whether the compiled step runs its layers unrolled on a GPU (`scan_unroll` 0, auto, or every layer)."""
    unroll = job.policy.scan_unroll
    return compiler == "gpu" and (unroll == 0 or unroll >= job.cfg.n_layers)


def unrolled_places(exact: dict[str, int], sizes: dict[str, int]) -> dict[str, dict[str, int]]:
    """The two ends of an unrolled backward pass (`UNROLLED_WORKING_SET`): place -> term -> bytes."""
    working = {k: int(c * sizes[k]) for k, c in UNROLLED_WORKING_SET.items()}
    layers = sizes["layers"]
    one_layer_grads, one_layer_acts = sizes["layer_gradients"] // layers, exact["activations"] // layers
    return {
        "backward start": {
            **working,
            "gradients": one_layer_grads + sizes["tables"],
            "activations": exact["activations"],
        },
        "backward end": {**working, "gradients": exact["gradients"], "activations": one_layer_acts},
    }


def compiler_for(hardware: str) -> str:
    """The compiler whose buffer assignment is modelled, for a hardware catalog name (`tpu-v5p`) or a JAX
    device kind (`TPU v5 lite`, `NVIDIA H200`): "cpu" (XLA:CPU's `PLACES`), "gpu" (XLA:GPU: XLA:CPU's
    `PLACES` for a scanned layer loop, `UNROLLED_PLACES` for the unrolled one), "tpu" (XLA:TPU's), or the
    catalog name of a TPU with on-chip memory for temporaries ("tpu-v5e": XLA:TPU's with `onchip_bytes`)."""
    name = hardware.strip().lower()
    if name in GPU_NAMES or name.startswith("nvidia") or any(name == hw.device_kind.lower() for hw in GPUS):
        return "gpu"
    if not name.startswith("tpu"):
        return "cpu"
    for key, hw in CATALOG.items():
        if hw.onchip_bytes and name in (key, hw.device_kind.lower()):
            return key
    return "tpu"


def onchip_bytes(compiler: str) -> int:
    """On-chip memory the compiler keeps temporaries in (`Hardware.onchip_bytes`; 0 for "cpu" and "tpu")."""
    return int(CATALOG[compiler].onchip_bytes) if compiler in CATALOG else 0


# A layer loop over repeats of a local/global pattern of P layers (`ModelConfig.pattern_period`) keeps
# P - 1 more layers' working set and gathered weights (the `pattern` term of every place), at the
# coefficients the `layer` and `weights` terms have in XLA:CPU's forward and backward places: a
# gemma-like test model (pattern LG, 2,2,2,1) compiles 1.38 MB over its all-local twin, 1.09 x layer +
# 3.28 x weights predicts 1.38 MB.
PATTERN_LAYER, PATTERN_WEIGHTS = 1.09, 3.28

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
    scores = (2 + bool(c.attn_logit_softcap)) * Hl * loc.job.seq_len + 3 * Hl if loc.attention == "dense" else 0
    families = 4 * E * c.post_norms + 2 * (Hl + Kl) * D * c.qk_norm  # post-norms' and q/k norms' inputs, outputs
    return 6 * E + 6 * Ml + 2 * Hl * D + 2 * Kl * D + scores + 4 + families


@dataclass(frozen=True)
class MemoryPie:
    """Bytes per device. `temporaries_detail` names the parts of `temporaries` (negative where on-chip
    memory holds gradients or activations at the peak, `estimate`)."""

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
        return {
            "params": self.params,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "temporaries": self.temporaries,
            "total": self.total,
        }


def terms(job: Job, shape: MeshShape) -> tuple[dict[str, int], dict[str, int]]:
    """The memory pie's inputs on one device: the exact parts (params, gradients, optimizer, activations,
    batch) and the size of one buffer of each `PLACES` term."""
    loc = job.local(shape)
    cfg = job.cfg
    state = state_bytes(cfg, param_dtype=job.policy.param_dtype)
    a, p, n = job.act_bytes, job.param_bytes, loc.tokens
    grads = state.grads_bytes(shape)
    activations = cfg.n_layers * n * saved_per_token_layer(loc, job.policy.remat) * a
    fsdp = shape.fsdp * shape.sp > 1
    stream = n * cfg.d_model * a
    exact = {
        "params": state.params_bytes(shape),
        "gradients": grads,
        "optimizer": state.optimizer_bytes(shape),
        "activations": activations,
        "batch": BATCH_FIELDS * 4 * n * job.grad_accum,
    }
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
        "scores": loc.rows * loc.heads * loc.length**2 * 4 if shape.sp > 1 else 0,
        "cast_params": exact["params"] * a // p,
        # The layers' share of the gradients (the rest: embedding, head, final norm), for `unrolled_places`.
        "layers": cfg.n_layers,
        "layer_gradients": grads
        * cfg.n_layers
        * loc.w_layer
        // (cfg.n_layers * loc.w_layer + loc.w_table * (1 if cfg.tie_embeddings else 2)),
    }
    # One iteration of the layer loop runs a repeat of the local/global pattern: its other layers' working
    # set and gathered weights are live beside the first's, in either place.
    sizes["pattern"] = int(
        (cfg.pattern_period - 1) * (PATTERN_LAYER * sizes["layer"] + PATTERN_WEIGHTS * sizes["weights"])
    )
    return exact, sizes


def places(
    exact: dict[str, int],
    sizes: dict[str, int],
    shape: MeshShape,
    compiler: str = "cpu",
    loss: dict[str, float] | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes of each buffer each place holds in HBM (place -> term -> bytes) from `terms`' sizes, with the
    temporaries of `compiler`; on hardware with on-chip memory, each place's share on chip as a negative
    "on chip" term, and the loss place (`loss`, default `LOSS_PLACE`)."""
    table = PLACES["tpu" if compiler.startswith("tpu") else "cpu"]  # a GPU's scanned loop: XLA:CPU's
    held = {place: {k: int(c * sizes[k]) for k, c in coeffs.items()} for place, coeffs in table.items()}
    onchip = onchip_bytes(compiler)
    if onchip:
        for terms_held in held.values():
            terms_held["on chip"] = -min(onchip, onchip_eligible(terms_held, exact, shape))
        held["loss"] = {k: int(c * sizes[k]) for k, c in (LOSS_PLACE if loss is None else loss).items()}
    return held


def estimate(job: Job, shape: MeshShape, compiler: str = "cpu") -> MemoryPie:
    """The memory pie of one device on a mesh without pipeline stages, with the temporaries of `compiler`
    ("cpu", "gpu", "tpu" or a TPU with on-chip memory; `compiler_for(hardware)` picks it)."""
    exact, sizes = terms(job, shape)
    grads, activations = exact["gradients"], exact["activations"]
    unrolled = unrolled_on_gpu(job, compiler)
    live = unrolled_places(exact, sizes) if unrolled else places(exact, sizes, shape, compiler)
    place = max(live, key=lambda name: sum(live[name].values()))
    # Temporaries: the place's buffers, less the gradients and activations counted in the pie.
    detail = {f"{k} ({place} pass)": v for k, v in live[place].items() if k not in ("gradients", "activations") and v}
    held_grads_acts = live[place].get("gradients", 0) + live[place].get("activations", 0)
    detail["gradients and activations not live at the peak"] = held_grads_acts - grads - activations
    detail["batch"] = exact["batch"]
    # With on-chip memory, or an unrolled layer loop, the temporaries can be negative: gradients and saved
    # activations counted in the pie that are on chip at the peak, or not yet made or already freed.
    exact_net = onchip_bytes(compiler) or unrolled
    temporaries = sum(detail.values()) if exact_net else max(0, sum(detail.values()))
    return MemoryPie(exact["params"], grads, exact["optimizer"], activations, temporaries, detail)
