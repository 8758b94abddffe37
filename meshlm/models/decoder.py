"""The decoder in Flax NNX, math only: one model that every family (LLaMA, Mistral, Qwen, Gemma) configures.

The model is three parts, and every way of running it goes through them: `embed_tokens`, the layer
loop `run_layers` (one scan, under the `--remat` policy) and `head`. `__call__` composes them; a
placement with per-layer-range strategies runs `run_layers` once per layer group, a pipeline stage on
its own layers; prefill and decode unroll the layers around the same embedding and head. A layer
(`meshlm.models.layers.Block`) is local or global by the config's `layer_pattern`: with both kinds the
scan runs one repeat of the pattern per iteration, each layer of it with its own attention.

Nothing here knows mesh axis names: parameters name logical axes (`meshlm.axes`), `meshlm.sharding`
maps them onto the mesh. Shapes: B batch, T length, E d_model, V vocab, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshlm import axes, sharding
from meshlm.backends import traced_profile
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig
from meshlm.models.layers import Block, LayerCache, RMSNorm, cache_positions, embed_scale, param, rms_norm
from meshlm.models.loss import head_loss_sums, project, soft_cap
from meshlm.models.policy import RunPolicy
from meshlm.models.remat import POLICIES as REMAT_NAMES
from meshlm.models.remat import checkpoint_policy

# What each layer keeps for its backward pass (the rest is recomputed there): meshlm.models.remat.
REMAT_POLICIES = {name: checkpoint_policy(name) for name in REMAT_NAMES}


def scan_unroll(policy: RunPolicy, count: int) -> int:
    """Layers per iteration of a loop over `count` layers: `policy.scan_unroll`, or for 0 (auto) all of
    them where the backend's profile unrolls the loop (GPU: the loop's per-layer copies of its stacked
    residuals cost more there than the longer compile), else one compiled layer."""
    if policy.scan_unroll:
        return max(1, min(policy.scan_unroll, count))
    return count if traced_profile().unroll_layers else 1


class Decoder(nnx.Module):
    """Token ids [B, T] -> float32 logits [B, T, V]. Layers are stacked on a leading `layers` axis and scanned.

    The parts take the weights they use from an optional parameter tree (the model's own when None), so
    that code holding only some of the weights runs them too: a pipeline stage, a layer group."""

    def __init__(self, cfg: ModelConfig, policy: RunPolicy, rngs: nnx.Rngs):
        if policy.remat == "auto":  # RunPolicy checks the names; auto is the job's to resolve first
            raise UsageError(f"--remat=auto is resolved by the job; choose one of {', '.join(REMAT_POLICIES)}")
        self.cfg, self.policy = cfg, policy
        pd = policy.param_dtype
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), axes.EMBED_TABLE, cfg.init_std, pd)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return Block(cfg, policy, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg, policy, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), axes.HEAD, cfg.init_std, pd)

    def __call__(self, tokens, positions=None, segment_ids=None, *, return_kv: bool = False, select=None):
        """Logits [B, T, V] (or [B, 1, V] at index `select` [B] of each row).

        With `return_kv`, also each layer's keys and values stacked on a leading layers axis,
        ([L, B, T, K, D], [L, B, T, K, D]): a prefill that fills a KV cache."""
        x, positions = self.embed_tokens(tokens, positions)
        x, kv = self.run_layers(x, positions, segment_ids, return_kv=return_kv)
        logits = self.head(_select(x, select))
        return (logits, kv) if return_kv else logits

    # ------------------------------------------------------------------------------- the three parts

    def embed_tokens(self, tokens, positions=None, params=None):
        """(activations [B, T, E] in the compute dtype, positions [B, T]: 0 .. T-1 in each row when None).
        `params`: a tree whose `embed` is the table to use instead of this model's own."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        table = self.embed[...] if params is None else params["embed"]
        # The table stays as it is stored, cast to the compute dtype: its vocab split over the model axis
        # (each shard looks up its own rows, one reduction assembles them) and its embed dimension split
        # for memory. The token ids go to the table rather than the table to the ids (`sharding.lookup`).
        x = sharding.lookup(table.astype(jnp.dtype(self.policy.dtype)), tokens)
        if (scale := embed_scale(self.cfg)) != 1.0:
            x = x * jnp.asarray(scale, x.dtype)  # in the compute dtype, as the families' own code rounds it
        return sharding.constrain(x, axes.STREAM), positions

    def run_layers(
        self, x, positions, segment_ids=None, layers=None, *, return_kv: bool = False, adapt=None, first: int = 0
    ):
        """The layer loop: one scan over stacked layers, each layer under the `policy.remat` policy.

        `layers`: a stacked-layers parameter tree (leading axis: its layers; the tree of `params["layers"]`)
        to run instead of this model's own, e.g. one layer group's or one pipeline stage's; `first`: the
        index of its first layer in the model (which says which of them are local). `adapt`: a function
        from one layer's slice of `layers` to that layer's weights, run inside the scan (LoRA merges each
        layer's adapters there, one layer at a time). Returns (x, kv): kv the stacked (keys, values) with
        `return_kv`, else None."""
        graphdef, own = nnx.split(self.layers)
        stacked = own if layers is None else layers
        count = jax.tree.leaves(stacked)[0].shape[0]
        period = min(self.cfg.pattern_period, count)
        kinds = self.cfg.local_layers[first : first + period]
        groups, rest = divmod(count, period)
        unroll = scan_unroll(self.policy, groups)
        # A scan of one layer per iteration keeps each recomputation in the backward loop; with several
        # layers in straight-line code XLA would merge it with the forward's (common subexpressions) and
        # keep every activation, as with `none`, unless each layer's recomputation is fenced off.
        layer = self._layer_fn(graphdef, positions, segment_ids, adapt, fenced=unroll > 1 or period > 1)

        def group(x, params):  # one repeat of the local/global pattern: `period` layers
            kvs = []
            for j, local in enumerate(kinds):
                x, kv = layer(x, jax.tree.map(lambda a, j=j: a[j], params) if period > 1 else params, local)
                kvs.append(kv)
            kv = None if not return_kv else (kvs[0] if period == 1 else jax.tree.map(lambda *a: jnp.stack(a), *kvs))
            return x, kv

        if period > 1:  # the whole repeats, [groups, period, ...]
            repeats = jax.tree.map(lambda a: a[: groups * period].reshape(groups, period, *a.shape[1:]), stacked)
        x, kv = jax.lax.scan(group, x, repeats if period > 1 else stacked, unroll=unroll)
        if period > 1:  # [groups, period, ...] -> [layers, ...], then the layers after the last whole repeat
            kv = None if kv is None else jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), kv)
            tail = []
            for j in range(rest):
                x, kv_j = layer(x, jax.tree.map(lambda a, j=j: a[groups * period + j], stacked), kinds[j])
                tail.append(kv_j)
            if return_kv and tail:
                kv = jax.tree.map(lambda a, *more: jnp.concatenate([a, jnp.stack(more)]), kv, *tail)
        return x, kv

    def _layer_fn(self, graphdef, positions, segment_ids, adapt, *, fenced: bool):
        """(x, one layer's weights, local) -> (x, (k, v)): one layer, under the remat policy."""
        policy = REMAT_POLICIES[self.policy.remat] if self.policy.remat != "none" else None

        def run(local: bool):
            def layer(x, params):
                if adapt is not None:
                    params = adapt(params)
                return nnx.merge(graphdef, params)(x, positions, segment_ids, local=local)

            return layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=fenced)

        both = {local: run(local) for local in (False, True)}
        return lambda x, params, local: both[local](x, params)

    def head(self, x, params=None):
        """Final norm and output projection: float32 logits [B, T, V] (soft-capped where the config says).
        `params`: a tree with `final_norm` and the output weights (`embed` when tied, else `lm_head`) to use
        instead of this model's own."""
        return soft_cap(project(*self._head_input(x, params)), self.cfg.final_logit_softcap)

    def head_loss(self, x, targets, loss_mask, params=None, *, one_hot: bool = False):
        """The head and the token loss in one: (sum of the losses of tokens whose `loss_mask` is 1, their
        number), float32, with the logits computed `policy.loss_chunk` positions at a time and never kept
        whole (`meshlm.models.loss.head_loss_sums`). `params` as for `head`."""
        x, weights = self._head_input(x, params)
        chunk, cap = self.policy.loss_chunk, self.cfg.final_logit_softcap
        return head_loss_sums(x, weights, targets, loss_mask, chunk=chunk, one_hot=one_hot, softcap=cap)

    def _head_input(self, x, params=None):
        """(the final-normed stream, the output weights [E, V]) from this model's or `params`' weights."""
        cfg = self.cfg
        if params is None:
            scale = self.final_norm.scale[...]
            weights = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        else:
            scale = params["final_norm"]["scale"]
            weights = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
        return rms_norm(x, scale, cfg.norm_eps, cfg.norm_offset), weights

    # ------------------------------------------------------------------------- unrolled, for serving

    def decode(self, tokens, positions, cache_k, cache_v, layers=None, length: int | None = None):
        """One step with a KV cache: tokens and positions [b, T] (usually T = 1) for the cache's first b
        rows, caches are tuples of L arrays [B, S, K, D] (a local layer's S may be its window: a ring,
        `LayerCache`). Returns (logits [b, T, V], new cache_k, new cache_v). Attention reads only the
        first `length` slots of each row (all when None): every position written so far must lie below it.

        The layers run unrolled so that each layer's cache is its own buffer, updated in place.
        `layers` (see `blocks`) gives each layer's weights as their own buffers too."""
        x, positions = self.embed_tokens(tokens, positions)
        newest = jnp.max(positions, axis=1, keepdims=True)
        new_k, new_v = [], []
        for i, (block, local) in enumerate(zip(self.blocks(layers), self.cfg.local_layers)):
            size = cache_k[i].shape[1]
            read = size if length is None else min(length, size)
            cache = LayerCache(cache_k[i], cache_v[i], cache_positions(newest, size, read, local), local)
            x, (k, v) = block(x, positions, None, cache, local=local)
            new_k.append(k)
            new_v.append(v)
        return self.head(x), tuple(new_k), tuple(new_v)

    def prefill(self, tokens, positions=None, *, layers=None, select=None):
        """`__call__(tokens, positions, return_kv=True, select=select)` with the layers unrolled over
        `layers` (see `blocks`): (logits, keys, values), keys and values tuples of L arrays [B, T, K, D]."""
        x, positions = self.embed_tokens(tokens, positions)
        keys, values = [], []
        for block, local in zip(self.blocks(layers), self.cfg.local_layers):
            x, (k, v) = block(x, positions, None, local=local)
            keys.append(k)
            values.append(v)
        return self.head(_select(x, select)), tuple(keys), tuple(values)

    def blocks(self, layers=None) -> list[Block]:
        """The L blocks, one at a time. `layers`: a sequence of L per-layer parameter trees (the stacked
        `layers` entry of the parameters split on its leading axis); without it, slices of the stacked
        weights, which XLA copies out on CPU before each matmul: separate buffers save that traffic."""
        graphdef, stacked = nnx.split(self.layers)
        if layers is None:
            layers = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(self.cfg.n_layers)]
        return [nnx.merge(graphdef, state) for state in layers]


def _select(x, select):
    """x [B, T, E] -> [B, 1, E] at index `select` [B] of each row; x itself when `select` is None."""
    return x if select is None else jnp.take_along_axis(x, select[:, None, None], axis=1)
