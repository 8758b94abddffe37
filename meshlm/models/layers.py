"""One decoder layer in Flax NNX, math only: RMSNorm, attention, the gated MLP, and the block around them.

Every parameter names the logical axes of its dimensions (`axes.MLP_IN` = ("embed", "mlp")); activations
are pinned with `sharding.constrain(x, axes.STREAM)` at the key operators. The optional parts (biases, q/k
norms, post-norms) exist only where the `ModelConfig` field asks for them. A layer is local (sliding
window) or global by the `local` argument of its call, so one stacked, scanned structure serves both.

Shapes: B batch, T length, E d_model, H query heads, K kv heads, D head_dim, M mlp_dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshlm import axes, sharding
from meshlm.models.configs import ModelConfig
from meshlm.models.policy import RunPolicy
from meshlm.models.rope import apply_rope, rope_frequencies
from meshlm.ops import kernels
from meshlm.ops.decode import decode_attention
from meshlm.ops.linear import linear
from meshlm.ops.ring import ring_attention


def param(rngs: nnx.Rngs, shape, logical, std: float, dtype) -> nnx.Param:
    """A weight drawn from N(0, std), or (std == 0) ones."""
    init = nnx.initializers.normal(std) if std > 0 else nnx.initializers.ones
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=logical)


def zeros(shape, logical, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype), out_sharding=logical)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """x / rms(x) · (offset + scale) over the last axis, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (offset + scale.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Over the last axis (`size` wide); its weight starts at the identity: ones, or zeros under an offset."""

    def __init__(self, cfg: ModelConfig, policy: RunPolicy, rngs: nnx.Rngs, size: int = 0, logical=axes.NORM):
        self.eps, self.offset = cfg.norm_eps, cfg.norm_offset
        shape = (size or cfg.d_model,)
        if cfg.norm_offset:
            self.scale = zeros(shape, logical, policy.param_dtype)
        else:
            self.scale = param(rngs, shape, logical, 0.0, policy.param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.offset)


class LayerCache(NamedTuple):
    """One layer's KV cache while decoding. A global layer's slot s holds the token at position s; a local
    layer's cache is a ring of at least its window's slots, the token at position p in slot p mod S.

    k, v          [B, S, K, D]  laid out as (batch, cache_length, kv_heads, head_dim)
    kv_positions  [b, L] int32  the position each of the first L slots holds (-1: none yet); the step
                                runs the cache's first b rows and attends their first L slots
    ring          whether slots wrap (a local layer's); one new token per row and step then
    """

    k: jax.Array
    v: jax.Array
    kv_positions: jax.Array
    ring: bool = False

    def write(self, k_new, v_new, positions):
        """Store the new tokens' keys and values [b, T, K, D] of the first b rows at their positions [b, T]
        (in place when donated)."""
        rows = jnp.arange(k_new.shape[0])[:, None]
        size = self.k.shape[1]
        if self.ring and k_new.shape[1] > 1:
            raise ValueError(f"a ring cache takes one new token per row and step, not {k_new.shape[1]}")
        slots = positions % size if self.ring else jnp.minimum(positions, size - 1)
        k = self.k.at[rows, slots].set(k_new.astype(self.k.dtype), mode="promise_in_bounds")
        v = self.v.at[rows, slots].set(v_new.astype(self.v.dtype), mode="promise_in_bounds")
        return sharding.constrain(k, axes.KV_CACHE), sharding.constrain(v, axes.KV_CACHE)


def cache_positions(newest: jax.Array, size: int, read: int, ring: bool) -> jax.Array:
    """[b, read] the position each of the first `read` slots of a cache of `size` slots holds once the
    row's newest position [b, 1] is written (-1: empty)."""
    slots = jnp.arange(read, dtype=jnp.int32)[None, :]
    held = newest - (newest - slots) % size if ring else slots
    return jnp.where((held >= 0) & (held <= newest), held, -1)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE; RingAttention over the sequence axis when it is sharded."""

    def __init__(self, cfg: ModelConfig, policy: RunPolicy, rngs: nnx.Rngs):
        E, H, K, D, std, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std, policy.param_dtype
        self.cfg, self.policy = cfg, policy
        self.wq = param(rngs, (E, H, D), axes.WQ, std, pd)
        self.wk = param(rngs, (E, K, D), axes.WKV, std, pd)
        self.wv = param(rngs, (E, K, D), axes.WKV, std, pd)
        self.wo = param(rngs, (H, D, E), axes.WO, std, pd)
        if cfg.qkv_bias:
            self.bq = zeros((H, D), axes.WQ[1:], pd)
            self.bk, self.bv = zeros((K, D), axes.WKV[1:], pd), zeros((K, D), axes.WKV[1:], pd)
        if cfg.out_bias:
            self.bo = zeros((E,), axes.NORM, pd)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, policy, rngs, D, axes.WQ[2:])
            self.k_norm = RMSNorm(cfg, policy, rngs, D, axes.WQ[2:])

    def __call__(self, x, positions, segment_ids, cache: LayerCache | None = None, *, local: bool = False):
        """Returns (output, (k, v)): this call's keys and values, or with `cache` the updated cache.
        `local`: attend only the last `cfg.sliding_window` positions."""
        cfg = self.cfg
        q, k, v = self._project(x)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, k, positions, local)
        # More tp ranks than kv heads: each rank gets its own copy of the kv head its queries use
        # (the projections are whole on every rank then; see `sharding.replicate_short_kv_heads`).
        if (copies := sharding.kv_head_copies(cfg.n_kv_heads, cfg.n_heads)) > 1:
            k, v = jnp.repeat(k, copies, axis=2), jnp.repeat(v, copies, axis=2)
        k, v = sharding.constrain(k, axes.KEYS), sharding.constrain(v, axes.KEYS)
        q, k, v = (checkpoint_name(t, "qkv") for t in (q, k, v))
        score = dict(window=cfg.sliding_window if local else 0, softcap=cfg.attn_logit_softcap,
                     scale=cfg.attention_scale or None)  # fmt: skip
        if cache is None:
            run = self.policy
            out = attend(q, k, v, positions, segment_ids, kernel=run.attention, max_documents=run.max_documents,
                         **score)  # fmt: skip
        else:
            k, v = cache.write(k, v, positions)
            rows, length = cache.kv_positions.shape
            out = decode_attention(q, k[:rows, :length], v[:rows, :length], positions, cache.kv_positions, **score)
        # The attention kernels tag their own output (and log-sum-exp) for the remat policies.
        out = sharding.constrain(out, axes.QUERIES)
        out = linear("bthd,hde->bte", out, self.wo[...])
        if cfg.out_bias:
            out = out + self.bo[...].astype(out.dtype)
        return checkpoint_name(out, "attn_proj"), (k, v)

    def _project(self, x):
        q = linear("bte,ehd->bthd", x, self.wq[...])
        k = linear("bte,ekd->btkd", x, self.wk[...])
        v = linear("bte,ekd->btkd", x, self.wv[...])
        if self.cfg.qkv_bias:
            q, k, v = (t + b[...].astype(t.dtype) for t, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        return q, k, v

    def _rotate(self, q, k, positions, local: bool):
        """RoPE on queries and keys: local layers with `local_rope_theta` (unscaled) where it is set."""
        cfg = self.cfg
        if local and cfg.local_rope_theta:
            inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.local_rope_theta, None)
        else:
            inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # trace-time constants
        q = sharding.constrain(apply_rope(q, positions, inv_freq, factor), axes.QUERIES)
        return q, apply_rope(k, positions, inv_freq, factor)


def attend(q, k, v, positions, segment_ids, kernel: str = "auto", max_documents: int = kernels.MAX_DOCUMENTS,
           **score):  # fmt: skip
    """Causal attention: RingAttention when `length` is sharded, else the `kernel` (`--attention`) that
    `meshlm.ops.kernels` runs for the platform of the active mesh (auto: splash on TPU, cuDNN or Triton
    on GPU, dense below 256 tokens and blockwise from there on CPU). `score`: window, softcap, scale."""
    ring = sharding.ring_spec()
    kw = dict(q_positions=positions, kv_positions=positions, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    if ring is not None:
        return ring_attention(
            q, k, v, **kw, **score, mesh=ring.mesh, axis_name=ring.axis_name, qkv_spec=ring.qkv_spec,
            seq_spec=ring.seq_spec, kernel=kernel, order=ring.order,
        )  # fmt: skip
    # The mesh the model is traced for says the platform (a TPU topology compiles on a CPU host) and
    # gives the layout the fused kernels run per shard in.
    found = sharding.kernel_layout()
    if found is None:
        return kernels.attention(q, k, v, **kw, **score, kernel=kernel, max_documents=max_documents)
    layout = kernels.Layout(mesh=found.mesh, q_spec=found.q_spec, kv_spec=found.kv_spec, seq_spec=found.seq_spec)
    return kernels.attention(q, k, v, **kw, **score, kernel=kernel, platform=found.platform, layout=layout,
                             max_documents=max_documents)  # fmt: skip


ACTIVATION = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """Gated: down(act(x @ gate) * (x @ up)), SwiGLU or GeGLU by `cfg.mlp_activation`."""

    def __init__(self, cfg: ModelConfig, policy: RunPolicy, rngs: nnx.Rngs):
        E, M, std, pd = cfg.d_model, cfg.mlp_dim, cfg.init_std, policy.param_dtype
        self.act = ACTIVATION[cfg.mlp_activation]
        self.gate = param(rngs, (E, M), axes.MLP_IN, std, pd)
        self.up = param(rngs, (E, M), axes.MLP_IN, std, pd)
        self.down = param(rngs, (M, E), axes.MLP_OUT, std, pd)
        if cfg.mlp_bias:
            self.b_gate, self.b_up = zeros((M,), axes.MLP_OUT[:1], pd), zeros((M,), axes.MLP_OUT[:1], pd)
            self.b_down = zeros((E,), axes.NORM, pd)
        self.biased = cfg.mlp_bias

    def __call__(self, x):
        gate, up = linear("bte,em->btm", x, self.gate[...]), linear("bte,em->btm", x, self.up[...])
        if self.biased:
            gate, up = gate + self.b_gate[...].astype(gate.dtype), up + self.b_up[...].astype(up.dtype)
        h = sharding.constrain(self.act(gate) * up, axes.HIDDEN)
        out = linear("btm,me->bte", h, self.down[...])
        return out + self.b_down[...].astype(out.dtype) if self.biased else out


class Block(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); with `post_norms` each output is normed before its add."""

    def __init__(self, cfg: ModelConfig, policy: RunPolicy, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, policy, rngs)
        self.attn = Attention(cfg, policy, rngs)
        self.mlp_norm = RMSNorm(cfg, policy, rngs)
        self.mlp = MLP(cfg, policy, rngs)
        self.post_norms = cfg.post_norms
        if cfg.post_norms:
            self.post_attn_norm = RMSNorm(cfg, policy, rngs)
            self.post_mlp_norm = RMSNorm(cfg, policy, rngs)

    def __call__(self, x, positions, segment_ids, cache: LayerCache | None = None, *, local: bool = False):
        h, kv = self.attn(self.attn_norm(x), positions, segment_ids, cache, local=local)
        x = x + (self.post_attn_norm(h) if self.post_norms else h)
        h = self.mlp(self.mlp_norm(x))
        x = x + (self.post_mlp_norm(h) if self.post_norms else h)
        return sharding.constrain(x, axes.STREAM), kv


def embed_scale(cfg: ModelConfig) -> float:
    """What the embeddings are multiplied by: sqrt(d_model) where `cfg.embed_scale`, else 1."""
    return math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0


__all__ = [
    "Attention",
    "Block",
    "LayerCache",
    "cache_positions",
    "MLP",
    "RMSNorm",
    "attend",
    "embed_scale",
    "param",
    "rms_norm",
]
