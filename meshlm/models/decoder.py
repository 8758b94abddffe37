"""The LLaMA-family decoder in Flax NNX: math only.

Every parameter names the logical axes of its dimensions (`axes.MLP_IN` = ("embed", "mlp")); activations
are pinned with `sharding.constrain(x, axes.STREAM)` at the key operators. Nothing here knows mesh axis
names: `meshlm.sharding` maps the logical names onto the mesh.

The model is three parts, and every way of running it goes through them: `embed_tokens`, the layer
loop `run_layers` (one scan, under the `--remat` policy) and `head`. `__call__` composes them; a
placement with per-layer-range strategies runs `run_layers` once per layer group, a pipeline stage on
its own layers; prefill and decode unroll the layers around the same embedding and head.

Shapes: B batch, T length, E d_model, H query heads, K kv heads, D head_dim, M mlp_dim, V vocab, L layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshlm import axes, sharding
from meshlm.backends import traced_profile
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, RopeScaling
from meshlm.models.loss import head_loss_sums, project
from meshlm.models.remat import POLICIES as REMAT_NAMES
from meshlm.models.remat import checkpoint_policy
from meshlm.ops import kernels
from meshlm.ops.decode import decode_attention
from meshlm.ops.linear import linear
from meshlm.ops.ring import ring_attention

# What each layer keeps for its backward pass (the rest is recomputed there): meshlm.models.remat.
REMAT_POLICIES = {name: checkpoint_policy(name) for name in REMAT_NAMES}


def _param(rngs: nnx.Rngs, shape, logical, std: float, dtype) -> nnx.Param:
    init = nnx.initializers.normal(std) if std > 0 else nnx.initializers.ones
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=logical)


# ------------------------------------------------------------------------------------------- RoPE


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """Inverse frequencies [D/2], with Llama-3 scaling: long wavelengths slowed by `factor`, short kept."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv.astype(np.float32)
    old = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / scaling.factor, np.where(wavelen < high_wavelen, inv, blended))
    return out.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate [B, T, N, D] by position, halves convention (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ----------------------------------------------------------------------------------------- layers


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) · scale over the last axis, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = _param(rngs, (cfg.d_model,), axes.NORM, 0.0, cfg.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE; RingAttention over the sequence axis when it is sharded."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, H, K, D, std, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std, cfg.param_dtype
        self.cfg = cfg
        self.wq = _param(rngs, (E, H, D), axes.WQ, std, pd)
        self.wk = _param(rngs, (E, K, D), axes.WKV, std, pd)
        self.wv = _param(rngs, (E, K, D), axes.WKV, std, pd)
        self.wo = _param(rngs, (H, D, E), axes.WO, std, pd)

    def __call__(self, x, positions, segment_ids, cache: LayerCache | None = None):
        """Returns (output, (k, v)): this call's keys and values, or with `cache` the updated cache."""
        cfg = self.cfg
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # a trace-time constant
        q = linear("bte,ehd->bthd", x, self.wq[...])
        k = linear("bte,ekd->btkd", x, self.wk[...])
        v = linear("bte,ekd->btkd", x, self.wv[...])
        q = sharding.constrain(apply_rope(q, positions, inv_freq), axes.QUERIES)
        k = apply_rope(k, positions, inv_freq)
        # More tp ranks than kv heads: each rank gets its own copy of the kv head its queries use
        # (the projections are whole on every rank then; see `sharding.replicate_short_kv_heads`).
        if (copies := sharding.kv_head_copies(cfg.n_kv_heads, cfg.n_heads)) > 1:
            k, v = jnp.repeat(k, copies, axis=2), jnp.repeat(v, copies, axis=2)
        k, v = sharding.constrain(k, axes.KEYS), sharding.constrain(v, axes.KEYS)
        q, k, v = (checkpoint_name(t, "qkv") for t in (q, k, v))
        if cache is None:
            out = attend(q, k, v, positions, segment_ids, kernel=cfg.attention, max_documents=cfg.max_documents)
        else:
            k, v = cache.write(k, v, positions)
            rows, length = cache.kv_positions.shape
            out = decode_attention(q, k[:rows, :length], v[:rows, :length], positions, cache.kv_positions)
        # The attention kernels tag their own output (and log-sum-exp) for the remat policies.
        out = sharding.constrain(out, axes.QUERIES)
        return checkpoint_name(linear("bthd,hde->bte", out, self.wo[...]), "attn_proj"), (k, v)


class LayerCache(NamedTuple):
    """One layer's KV cache while decoding: slot s of row b holds the token at position s.

    k, v          [B, S, K, D]  laid out as (batch, cache_length, kv_heads, head_dim)
    kv_positions  [b, L] int32  s where slot s is filled (s <= the row's newest position), else -1;
                                the step runs the cache's first b rows and attends their first L slots
    """

    k: jax.Array
    v: jax.Array
    kv_positions: jax.Array

    def write(self, k_new, v_new, positions):
        """Store the new tokens' keys and values [b, T, K, D] of the first b rows at their positions [b, T]
        (in place when donated)."""
        rows = jnp.arange(k_new.shape[0])[:, None]
        slots = jnp.minimum(positions, self.k.shape[1] - 1)
        k = self.k.at[rows, slots].set(k_new.astype(self.k.dtype), mode="promise_in_bounds")
        v = self.v.at[rows, slots].set(v_new.astype(self.v.dtype), mode="promise_in_bounds")
        return sharding.constrain(k, axes.KV_CACHE), sharding.constrain(v, axes.KV_CACHE)


def scan_unroll(cfg: ModelConfig, count: int) -> int:
    """Layers per iteration of a loop over `count` layers: `cfg.scan_unroll`, or for 0 (auto) all of
    them where the backend's profile unrolls the loop (GPU: the loop's per-layer copies of its stacked
    residuals cost more there than the longer compile), else one compiled layer."""
    if cfg.scan_unroll:
        return max(1, min(cfg.scan_unroll, count))
    return count if traced_profile().unroll_layers else 1


def attend(q, k, v, positions, segment_ids, kernel: str = "auto", max_documents: int = kernels.MAX_DOCUMENTS):
    """Causal attention: RingAttention when `length` is sharded, else the `kernel` (`--attention`) that
    `meshlm.ops.kernels` runs for the platform of the active mesh (auto: splash on TPU, cuDNN or Triton
    on GPU, dense below 256 tokens and blockwise from there on CPU)."""
    ring = sharding.ring_spec()
    kw = dict(q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    if ring is not None:
        return ring_attention(
            q, k, v, **kw, mesh=ring.mesh, axis_name=ring.axis_name, qkv_spec=ring.qkv_spec, seq_spec=ring.seq_spec
        )
    # The mesh the model is traced for says the platform (a TPU topology compiles on a CPU host) and
    # gives the layout the fused kernels run per shard in.
    found = sharding.kernel_layout()
    if found is None:
        return kernels.attention(q, k, v, **kw, kernel=kernel, max_documents=max_documents)
    layout = kernels.Layout(mesh=found.mesh, q_spec=found.q_spec, kv_spec=found.kv_spec, seq_spec=found.seq_spec)
    return kernels.attention(q, k, v, **kw, kernel=kernel, platform=found.platform, layout=layout,
                             max_documents=max_documents)  # fmt: skip


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, M, std, pd = cfg.d_model, cfg.mlp_dim, cfg.init_std, cfg.param_dtype
        self.gate = _param(rngs, (E, M), axes.MLP_IN, std, pd)
        self.up = _param(rngs, (E, M), axes.MLP_IN, std, pd)
        self.down = _param(rngs, (M, E), axes.MLP_OUT, std, pd)

    def __call__(self, x):
        h = jax.nn.silu(linear("bte,em->btm", x, self.gate[...])) * linear("bte,em->btm", x, self.up[...])
        h = sharding.constrain(h, axes.HIDDEN)
        return linear("btm,me->bte", h, self.down[...])


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, segment_ids, cache: LayerCache | None = None):
        h, kv = self.attn(self.attn_norm(x), positions, segment_ids, cache)
        x = x + h
        x = x + self.mlp(self.mlp_norm(x))
        return sharding.constrain(x, axes.STREAM), kv


class Decoder(nnx.Module):
    """Token ids [B, T] -> float32 logits [B, T, V]. Layers are stacked on a leading `layers` axis and scanned.

    The parts take the weights they use from an optional parameter tree (the model's own when None), so
    that code holding only some of the weights runs them too: a pipeline stage, a layer group."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        if cfg.remat not in REMAT_POLICIES:
            raise UsageError(f"--remat={cfg.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), axes.EMBED_TABLE, cfg.init_std, cfg.param_dtype)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), axes.HEAD, cfg.init_std, cfg.param_dtype)

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
        x = sharding.lookup(table.astype(jnp.dtype(self.cfg.dtype)), tokens)
        return sharding.constrain(x, axes.STREAM), positions

    def run_layers(self, x, positions, segment_ids=None, layers=None, *, return_kv: bool = False, adapt=None):
        """The layer loop: one scan over stacked layers, each layer under the `cfg.remat` policy.

        `layers`: a stacked-layers parameter tree (leading axis: its layers; the tree of `params["layers"]`)
        to run instead of this model's own, e.g. one layer group's or one pipeline stage's. `adapt`: a
        function from one layer's slice of `layers` to that layer's weights, run inside the scan (LoRA
        merges each layer's adapters there, one layer at a time). Returns (x, kv): kv the stacked (keys,
        values) with `return_kv`, else None."""
        graphdef, own = nnx.split(self.layers)

        def layer(x, params):
            if adapt is not None:
                params = adapt(params)
            x, kv = nnx.merge(graphdef, params)(x, positions, segment_ids)
            return x, (kv if return_kv else None)

        stacked = own if layers is None else layers
        unroll = scan_unroll(self.cfg, jax.tree.leaves(stacked)[0].shape[0])
        if self.cfg.remat != "none":
            # A scan of one layer per iteration keeps each recomputation in the backward loop; unrolled,
            # XLA would merge it with the forward's (common subexpressions) and keep every activation,
            # as with `none`, unless each layer's recomputation is fenced off.
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=unroll > 1)
        return jax.lax.scan(layer, x, stacked, unroll=unroll)

    def head(self, x, params=None):
        """Final norm and output projection: float32 logits [B, T, V]. `params`: a tree with `final_norm`
        and the output weights (`embed` when tied, else `lm_head`) to use instead of this model's own."""
        return project(*self._head_input(x, params))

    def head_loss(self, x, targets, loss_mask, params=None, *, one_hot: bool = False):
        """The head and the token loss in one: (sum of the losses of tokens whose `loss_mask` is 1, their
        number), float32, with the logits computed `cfg.loss_chunk` positions at a time and never kept
        whole (`meshlm.models.loss.head_loss_sums`). `params` as for `head`."""
        x, weights = self._head_input(x, params)
        return head_loss_sums(x, weights, targets, loss_mask, chunk=self.cfg.loss_chunk, one_hot=one_hot)

    def _head_input(self, x, params=None):
        """(the final-normed stream, the output weights [E, V]) from this model's or `params`' weights."""
        cfg = self.cfg
        if params is None:
            scale = self.final_norm.scale[...]
            weights = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        else:
            scale = params["final_norm"]["scale"]
            weights = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
        return rms_norm(x, scale, cfg.norm_eps), weights

    # ------------------------------------------------------------------------- unrolled, for serving

    def decode(self, tokens, positions, cache_k, cache_v, layers=None, length: int | None = None):
        """One step with a KV cache: tokens and positions [b, T] (usually T = 1) for the cache's first b
        rows, caches are tuples of L arrays [B, S, K, D]. Returns (logits [b, T, V], new cache_k, new
        cache_v). Attention reads only the first `length` slots of each row (all when None): every
        position written so far must lie below it.

        The layers run unrolled so that each layer's cache is its own buffer, updated in place.
        `layers` (see `blocks`) gives each layer's weights as their own buffers too."""
        x, positions = self.embed_tokens(tokens, positions)
        S = cache_k[0].shape[1] if length is None else length
        slots = jnp.arange(S, dtype=jnp.int32)
        newest = jnp.max(positions, axis=1, keepdims=True)
        kv_positions = jnp.where(slots[None, :] <= newest, slots[None, :], -1)
        new_k, new_v = [], []
        for i, block in enumerate(self.blocks(layers)):
            x, (k, v) = block(x, positions, None, LayerCache(cache_k[i], cache_v[i], kv_positions))
            new_k.append(k)
            new_v.append(v)
        return self.head(x), tuple(new_k), tuple(new_v)

    def prefill(self, tokens, positions=None, *, layers=None, select=None):
        """`__call__(tokens, positions, return_kv=True, select=select)` with the layers unrolled over
        `layers` (see `blocks`): (logits, keys, values), keys and values tuples of L arrays [B, T, K, D]."""
        x, positions = self.embed_tokens(tokens, positions)
        keys, values = [], []
        for block in self.blocks(layers):
            x, (k, v) = block(x, positions, None)
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
