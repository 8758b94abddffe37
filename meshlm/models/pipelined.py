"""The LLaMA model cut into pipeline stages: embedding, groups of layers, and the head with its loss.

`pipelined_loss_and_grads` gives what `jax.value_and_grad` of the train step's loss gives (the mean
token cross-entropy and its gradients for every parameter) but runs the layer stack through
`meshlm.ops.pipeline` over the `pp` mesh axis. Parameters keep the same tree and the same `[L, ...]`
stacked layers as without a pipeline, so checkpoints move freely between pp sizes: stage k takes
layers `k·L/S .. (k+1)·L/S - 1`.

The embedding runs in the first stage (it is recomputed in the backward pass, so no stage holds the
whole batch's activations), the head (final norm, output projection, loss) inside the last stage's
backward step, its logits `loss_chunk` positions at a time as without a pipeline. Both tables are
replicated over `pp`, and their gradients summed over it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from meshlm import axes, sharding
from meshlm.models.placement import Placement
from meshlm.ops.pipeline import Schedule, pipeline_value_and_grad


def to_stages(layers: Any, pp: int, virtual: int) -> Any:
    """[L, ...] stacked layers -> [pp, V, L/S, ...]; stage k = v·pp + r (layers k·L/S ..) at [r, v]."""

    def one(a):
        L = a.shape[0]
        return a.reshape(virtual, pp, L // (pp * virtual), *a.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(one, layers)


def from_stages(staged: Any) -> Any:
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), staged)


def pipelined_loss_and_grads(placement: Placement, schedule: Schedule, params: Any, batch: dict):
    """((sum of token losses, token count), gradients of the mean loss) for one batch, pipelined.

    Unlike the plain step, the gradients come back already divided by the token count. The stages run
    the model's own parts (`Decoder.embed_tokens`, `run_layers`, `head`) on the weights they hold."""
    cfg, mesh, model = placement.cfg, placement.mesh, placement.structure
    mb = sharding.micro_batches(batch, schedule.microbatches)
    count = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

    def first_fn(table, s):
        return model.embed_tokens(s["inputs"], None, {"embed": table})[0]

    def stage_fn(layers, x, s):
        return model.run_layers(x, s["positions"], s["segment_ids"], layers)[0]

    def head_fn(hp, x, s):
        total, _ = model.head_loss(x, s["targets"], s["loss_mask"], hp, one_hot=True)
        return total / count

    head = {"final_norm": params["final_norm"]}
    head.update({"embed": params["embed"]} if cfg.tie_embeddings else {"lm_head": params["lm_head"]})
    staged = to_stages(params["layers"], schedule.pp, schedule.virtual)
    with sharding.activate(mesh, placement.strategy):  # the stages' activations laid out as without a pipeline
        side = {k: sharding.constrain(v, (None, *axes.TOKENS)) for k, v in mb.items()}  # rows, length split
        loss, (g_embed, g_staged, g_head) = pipeline_value_and_grad(
            first_fn, stage_fn, head_fn, params["embed"], staged, head, side, schedule, mesh
        )
    grads = {
        "embed": g_embed + g_head.get("embed", 0.0),
        "layers": from_stages(g_staged),
        "final_norm": g_head["final_norm"],
    }
    if not cfg.tie_embeddings:
        grads["lm_head"] = g_head["lm_head"]
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return (loss * count, count), grads
