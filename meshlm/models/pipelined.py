"""The LLaMA model cut into pipeline stages: embedding, groups of layers, and the head with its loss.

`pipelined_loss_and_grads` gives what `jax.value_and_grad` of the train step's loss gives (the mean
token cross-entropy and its gradients for every parameter) but runs the layer stack through
`meshlm.ops.pipeline` over the `pp` mesh axis. Parameters keep the same tree and the same `[L, ...]`
stacked layers as without a pipeline, so checkpoints move freely between pp sizes: stage k takes
layers `k·L/S .. (k+1)·L/S - 1`.

The embedding runs in the first stage (it is recomputed in the backward pass, so no stage holds the
whole batch's activations), the head (final norm, output projection, loss) inside the last stage's
backward step. Both tables are replicated over `pp`, and their gradients summed over it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshlm import sharding
from meshlm.models.llama import Llama
from meshlm.models.placement import Placement, _build
from meshlm.ops.pipeline import Schedule, pipeline_value_and_grad

HEAD_KEYS = ("final_norm", "lm_head")


def _graphdefs(placement: Placement):
    abstract = nnx.eval_shape(lambda: _build(placement.cfg, 0))
    layer_def, _ = nnx.split(abstract.layers, nnx.Param)
    norm_def, _ = nnx.split(abstract.final_norm, nnx.Param)
    return layer_def, norm_def


def micro_batches(x: jax.Array, n: int) -> jax.Array:
    """[B, ...] -> [n, B/n, ...], microbatch i = rows i, i+n, ...: each data shard keeps its rows."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)


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

    Unlike the plain step, the gradients come back already divided by the token count."""
    cfg, mesh = placement.cfg, placement.mesh
    layer_def, norm_def = _graphdefs(placement)
    M = schedule.microbatches
    remat = cfg.remat != "none"
    mb = {k: micro_batches(v, M) for k, v in batch.items()}
    count = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

    def first_fn(table, s):  # the model's own embedding, on the table alone
        x, _ = Llama._embed(SimpleNamespace(embed=table, cfg=cfg), s["inputs"], None)
        return x

    def stage_fn(p, x, s):
        def body(x, layer_params):
            x, _ = nnx.merge(layer_def, layer_params)(x, s["positions"], s["segment_ids"])
            return x, None

        if remat:
            body = jax.checkpoint(body, prevent_cse=False)
        x, _ = jax.lax.scan(body, x, p)
        return x

    def head_fn(hp, x, s):
        x = nnx.merge(norm_def, hp["final_norm"])(x)
        w = hp["embed"].T if cfg.tie_embeddings else hp["lm_head"]
        logits = jnp.einsum("bte,ev->btv", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
        logits = sharding.constrain(logits, ("batch", "length", "vocab"))
        # The label's logit by a one-hot product, not a gather: XLA cannot partition a gather over a
        # vocab split across tp with rows split across the data axes inside the pp shard_map.
        picked = jnp.sum(logits * jax.nn.one_hot(s["targets"], logits.shape[-1], dtype=logits.dtype), axis=-1)
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        return jnp.sum(nll * s["loss_mask"].astype(jnp.float32)) / count

    head = {"final_norm": params["final_norm"]}
    head.update({"embed": params["embed"]} if cfg.tie_embeddings else {"lm_head": params["lm_head"]})
    staged = to_stages(params["layers"], schedule.pp, schedule.virtual)
    with sharding.activate(mesh, placement.strategy):  # the stages' activations laid out as without a pipeline
        side = {k: sharding.constrain(v, (None, "batch", "length")) for k, v in mb.items()}  # rows, length split
        loss, (g_embed, g_staged, g_head) = pipeline_value_and_grad(first_fn, stage_fn, head_fn, params["embed"], staged,
                                                                    head, side, schedule, mesh)
    grads = {"embed": g_embed + g_head.get("embed", 0.0), "layers": from_stages(g_staged),
             "final_norm": g_head["final_norm"]}
    if not cfg.tie_embeddings:
        grads["lm_head"] = g_head["lm_head"]
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return (loss * count, count), grads
