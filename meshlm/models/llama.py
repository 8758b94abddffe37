"""The LLaMA-family decoder in Flax NNX: math only.

Every parameter names the logical axes of its dimensions (`out_sharding=("embed", "mlp")`); activations
are pinned with `sharding.constrain(x, (...logical axes...))` at the key operators. Nothing here knows
mesh axis names: `meshlm.sharding` maps the logical names onto the mesh.

Shapes: B batch, T length, E d_model, H query heads, K kv heads, D head_dim, M mlp_dim, V vocab, L layers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshlm import sharding
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, RopeScaling

REMAT_POLICIES = {
    "none": None,  # keep every activation: fastest, most memory
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole layer in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs only
    "save_qkv_attn": jax.checkpoint_policies.save_only_these_names("qkv", "attn_out"),
}


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


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.eps = cfg.norm_eps
        self.scale = _param(rngs, (cfg.d_model,), ("embed",), 0.0, cfg.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE; RingAttention over the sequence axis when it is sharded."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, H, K, D, std, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std, cfg.param_dtype
        self.cfg = cfg
        self.wq = _param(rngs, (E, H, D), ("embed", "heads", "head_dim"), std, pd)
        self.wk = _param(rngs, (E, K, D), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wv = _param(rngs, (E, K, D), ("embed", "kv_heads", "head_dim"), std, pd)
        self.wo = _param(rngs, (H, D, E), ("heads", "head_dim", "embed"), std, pd)

    def __call__(self, x, positions, segment_ids, cache: LayerCache | None = None):
        """Returns (output, (k, v)): this call's keys and values, or with `cache` the updated cache."""
        dt, cfg = x.dtype, self.cfg
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # a trace-time constant
        q = jnp.einsum("bte,ehd->bthd", x, self.wq[...].astype(dt))
        k = jnp.einsum("bte,ekd->btkd", x, self.wk[...].astype(dt))
        v = jnp.einsum("bte,ekd->btkd", x, self.wv[...].astype(dt))
        q = sharding.constrain(apply_rope(q, positions, inv_freq), ("batch", "length", "heads", "head_dim"))
        k = sharding.constrain(apply_rope(k, positions, inv_freq), ("batch", "length", "kv_heads", "head_dim"))
        v = sharding.constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        q, k, v = (checkpoint_name(t, "qkv") for t in (q, k, v))
        if cache is None:
            out = attend(q, k, v, positions, segment_ids)
        else:
            k, v = cache.write(k, v, positions)
            rows, length = cache.kv_positions.shape
            out = attend_cache(q, k[:rows, :length], v[:rows, :length], positions, cache.kv_positions)
        out = checkpoint_name(sharding.constrain(out, ("batch", "length", "heads", "head_dim")), "attn_out")
        return jnp.einsum("bthd,hde->bte", out, self.wo[...].astype(dt)), (k, v)


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
        axes = ("batch", "cache_length", "kv_heads", "head_dim")
        k = self.k.at[rows, slots].set(k_new.astype(self.k.dtype), mode="promise_in_bounds")
        v = self.v.at[rows, slots].set(v_new.astype(self.v.dtype), mode="promise_in_bounds")
        return sharding.constrain(k, axes), sharding.constrain(v, axes)


def attend(q, k, v, positions, segment_ids):
    """Causal attention: RingAttention when `length` is sharded, blockwise (flash) when long, else dense."""
    from meshlm.ops import attention as ops

    ring = sharding.ring_spec()
    kw = dict(q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    if ring is not None:
        from meshlm.ops.ring import ring_attention

        return ring_attention(
            q, k, v, **kw, mesh=ring.mesh, axis_name=ring.axis_name, qkv_spec=ring.qkv_spec, seq_spec=ring.seq_spec
        )
    T = q.shape[1]
    if T >= 1024 and hasattr(ops, "blockwise_attention") and T % 512 == 0:
        return ops.blockwise_attention(q, k, v, **kw)
    return ops.dot_product_attention(q, k, v, **kw)


def attend_cache(q, k_cache, v_cache, positions, kv_positions):
    """New queries [B, T, H, D] against the whole cache [B, S, K, D]; empty and future slots are masked.

    Both products are plain matmuls over the cache as it lies, [B, S, K·D], against the queries laid
    out block-diagonally ([B, K·D, T·H]: head h's query fills the rows of its kv head only). A matmul
    with kv heads as a batch dimension would first copy the whole cache into a heads-major layout,
    every layer and every step; the block-diagonal form reads it once, in place, for K times the
    (few) multiply-adds. With the cache's length split over the mesh, each shard scores its own
    slots and the softmax reductions cross the shards: sequence-parallel decoding without gathering
    the cache."""
    B, T, H, D = q.shape
    S, K = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    f32 = jnp.float32
    eye = jnp.eye(K, dtype=f32)
    qg = q.astype(f32).reshape(B, T, K, G, D) * (1.0 / np.sqrt(D))
    q_blocks = jnp.einsum("btjgd,kj->bkdtjg", qg, eye).reshape(B, K * D, T * H)
    scores = jnp.einsum("bsx,bxy->bsy", k_cache.reshape(B, S, K * D).astype(f32), q_blocks)  # [B, S, T·H]
    allowed = (kv_positions[:, :, None] >= 0) & (kv_positions[:, :, None] <= positions[:, None, :])  # [B, S, T]
    scores = jnp.where(allowed[..., None], scores.reshape(B, S, T, H), -jnp.inf)
    top = jnp.max(scores, axis=1, keepdims=True)
    p = jnp.exp(scores - jnp.where(top == -jnp.inf, 0.0, top))  # masked slots: exactly 0
    total = jnp.sum(p, axis=1, keepdims=True)
    p = (p / jnp.where(total > 0, total, 1.0)).reshape(B, S, T * H)
    mixed = jnp.einsum("bsy,bsx->byx", p, v_cache.reshape(B, S, K * D).astype(f32))  # [B, T·H, K·D]
    out = jnp.einsum("btkgjd,kj->btkgd", mixed.reshape(B, T, K, G, K, D), eye)  # each head's own kv head
    return out.reshape(B, T, H, D).astype(q.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, M, std, pd = cfg.d_model, cfg.mlp_dim, cfg.init_std, cfg.param_dtype
        self.gate = _param(rngs, (E, M), ("embed", "mlp"), std, pd)
        self.up = _param(rngs, (E, M), ("embed", "mlp"), std, pd)
        self.down = _param(rngs, (M, E), ("mlp", "embed"), std, pd)

    def __call__(self, x):
        dt = x.dtype
        h = jax.nn.silu(x @ self.gate[...].astype(dt)) * (x @ self.up[...].astype(dt))
        h = sharding.constrain(h, ("batch", "length", "mlp"))
        return h @ self.down[...].astype(dt)


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
        return sharding.constrain(x, ("batch", "length", "embed")), kv


class Llama(nnx.Module):
    """Token ids [B, T] -> float32 logits [B, T, V]. Layers are stacked on a leading `layers` axis and scanned."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        if cfg.remat not in REMAT_POLICIES:
            raise UsageError(f"--remat={cfg.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, cfg.param_dtype)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, cfg.param_dtype)

    def __call__(self, tokens, positions=None, segment_ids=None, *, return_kv: bool = False, select=None):
        """Logits [B, T, V] (or [B, 1, V] at index `select` [B] of each row).

        With `return_kv`, also each layer's keys and values stacked on a leading layers axis,
        ([L, B, T, K, D], [L, B, T, K, D]): a prefill that fills a KV cache."""
        x, positions = self._embed(tokens, positions)

        def layer(x, block, positions, segment_ids):
            x, kv = block(x, positions, segment_ids)
            return x, (kv if return_kv else None)

        if self.cfg.remat != "none":
            layer = nnx.remat(layer, policy=REMAT_POLICIES[self.cfg.remat], prevent_cse=False)
        scan = nnx.scan(layer, in_axes=(nnx.Carry, 0, None, None), out_axes=(nnx.Carry, 0),
                        transform_metadata={nnx.PARTITION_NAME: "layers"})
        x, kv = scan(x, self.layers, positions, segment_ids)
        if select is not None:
            x = jnp.take_along_axis(x, select[:, None, None], axis=1)
        logits = self._head(x)
        return (logits, kv) if return_kv else logits

    def decode(self, tokens, positions, cache_k, cache_v, layers=None, length: int | None = None):
        """One step with a KV cache: tokens and positions [b, T] (usually T = 1) for the cache's first b
        rows, caches are tuples of L arrays [B, S, K, D]. Returns (logits [b, T, V], new cache_k, new
        cache_v). Attention reads only the first `length` slots of each row (all when None): every
        position written so far must lie below it.

        The layers run unrolled so that each layer's cache is its own buffer, updated in place.
        `layers` (see `blocks`) gives each layer's weights as their own buffers too."""
        x, positions = self._embed(tokens, positions)
        S = cache_k[0].shape[1] if length is None else length
        slots = jnp.arange(S, dtype=jnp.int32)
        newest = jnp.max(positions, axis=1, keepdims=True)
        kv_positions = jnp.where(slots[None, :] <= newest, slots[None, :], -1)
        new_k, new_v = [], []
        for i, block in enumerate(self.blocks(layers)):
            x, (k, v) = block(x, positions, None, LayerCache(cache_k[i], cache_v[i], kv_positions))
            new_k.append(k)
            new_v.append(v)
        return self._head(x), tuple(new_k), tuple(new_v)

    def prefill(self, tokens, positions=None, *, layers=None, select=None):
        """`__call__(tokens, positions, return_kv=True, select=select)` with the layers unrolled over
        `layers` (see `blocks`): (logits, keys, values), keys and values tuples of L arrays [B, T, K, D]."""
        x, positions = self._embed(tokens, positions)
        keys, values = [], []
        for block in self.blocks(layers):
            x, (k, v) = block(x, positions, None)
            keys.append(k)
            values.append(v)
        if select is not None:
            x = jnp.take_along_axis(x, select[:, None, None], axis=1)
        return self._head(x), tuple(keys), tuple(values)

    def blocks(self, layers=None) -> list[Block]:
        """The L blocks, one at a time. `layers`: a sequence of L per-layer parameter trees (the stacked
        `layers` entry of the parameters split on its leading axis); without it, slices of the stacked
        weights, which XLA copies out on CPU before each matmul: separate buffers save that traffic."""
        graphdef, stacked = nnx.split(self.layers)
        if layers is None:
            layers = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(self.cfg.n_layers)]
        return [nnx.merge(graphdef, state) for state in layers]

    def _embed(self, tokens, positions):
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        # Gather from a table whose vocab dim stays split over the model axis and whose embed dim is whole:
        # each shard looks up its own rows and one reduction assembles the activations.
        table = sharding.constrain(self.embed[...], ("vocab", "embed"))
        x = jnp.take(table, tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))
        return sharding.constrain(x, ("batch", "length", "embed")), positions

    def _head(self, x):
        cfg = self.cfg
        x = self.final_norm(x)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits = jnp.einsum("bte,ev->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
        return sharding.constrain(logits, ("batch", "length", "vocab"))
