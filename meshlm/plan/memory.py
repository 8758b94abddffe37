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
    save_qkv_attn  E + 2·Hl·D + 2·Kl·D             (the layer input, q, k, v, attention output)
    full           E                               (the layer input only)

Temporaries are sums of such terms, each with a coefficient: how many buffers of that size the
compiled step holds at its peak, fitted once to XLA's buffer assignment over a grid of models,
meshes and policies (`bench/plan_accuracy.py` prints how well it holds). The coefficients describe
XLA:CPU's schedule; other backends schedule differently, so treat the temporaries as an estimate
and the state, gradients and activations as the firm part. Peak memory is the
state plus the batch plus the largest live set, the figure `compiled.memory_analysis()` gives as
argument + output - alias + temp bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.mesh import MeshShape
from meshlm.plan.job import Job, Local
from meshlm.plan.state_bytes import state_bytes

# Buffers of each kind live at the peak (see the module docstring), fitted to XLA:CPU's buffer
# assignment over 32 (model, mesh, remat, batch, seq_len, grad_accum) cases on 8 devices: every
# case within -2.6% .. +7.9% of the compiled peak.
LOGITS_COPIES = 0.3  # float32 [n, V/tp] logits (XLA fuses most of the softmax into its neighbours)
TABLE_COPIES = 2.5  # [V/tp, E] in param dtype: the gathered table and head, their full-size gradients
STREAM_COPIES = 8.0  # [n, E]: the residual stream, norm outputs and their gradients in a layer's backward
LAYER_COPIES = 1.0  # one layer's tp-sharded activations (policy `none`, less the [n, E] ones)
WEIGHT_COPIES = 0.75  # one layer's fsdp-gathered weights
ACCUM_GRAD_COPIES = 2.0  # with gradient accumulation: running sums and one micro-batch's gradients
BATCH_FIELDS = 5  # inputs, targets, positions, segment_ids, loss_mask: 4 bytes per token each


def saved_per_token_layer(loc: Local, remat: str) -> int:
    """Elements one layer keeps per token for the backward pass under this remat policy."""
    c = loc.cfg
    E, Ml, Hl, Kl, D = c.d_model, loc.mlp, loc.heads, loc.kv_heads, c.head_dim
    if remat == "full":
        return E
    if remat == "save_dots":
        return 2 * E + 2 * Ml + Hl * D + 2 * Kl * D
    if remat == "save_qkv_attn":
        return E + 2 * Hl * D + 2 * Kl * D
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


def estimate(job: Job, shape: MeshShape) -> MemoryPie:
    loc = job.local(shape)
    cfg = job.cfg
    state = state_bytes(cfg)
    params, grads, opt = state.params_bytes(shape), state.grads_bytes(shape), state.optimizer_bytes(shape)
    a, p, n = job.act_bytes, job.param_bytes, loc.tokens
    activations = cfg.n_layers * n * saved_per_token_layer(loc, cfg.remat) * a
    fsdp = shape.fsdp * shape.sp > 1
    stream = n * cfg.d_model * a
    detail = {
        "logits": int(LOGITS_COPIES * n * loc.vocab * 4),
        "embedding tables": int(TABLE_COPIES * loc.w_table * p),
        "residual stream": int(STREAM_COPIES * stream),
        "layer working set": int(LAYER_COPIES * (n * saved_per_token_layer(loc, "none") * a - 6 * stream)),
        "gathered weights": int(WEIGHT_COPIES * loc.w_layer * p) if fsdp else 0,
        "accumulated gradients": int(ACCUM_GRAD_COPIES * grads) if job.grad_accum > 1 else 0,
        "batch": BATCH_FIELDS * 4 * n * job.grad_accum,
    }
    return MemoryPie(params, grads, opt, activations, sum(detail.values()), detail)
