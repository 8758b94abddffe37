"""The engine's device side: the decode state (KV cache and per-slot arrays) and the jitted steps over it.

`Steps` holds the model's weights split by layer, the `DecodeState` of every slot, and two compiled
functions, both donating the state so it is updated in place:

  prefill(tokens, lengths, slots, settings)  padded prompts [Bp, P] run through the model; their keys
                                             and values go into cache rows `slots`; first tokens sampled
  decode(rows, length)                       the first `rows` slots advance one token, attending the
                                             first `length` positions of the cache

Both take and return fixed layouts, so the state one step returns is exactly what the next expects.
Which requests own which slots is the scheduler's business (meshlm/serve/engine/batching.py), not this module's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshlm import sharding
from meshlm.models.layers import cache_positions
from meshlm.serve.engine.sampling import SlotSampling, sample


class DecodeState(NamedTuple):
    """Everything the device keeps per slot. Donated to every step: updated in place."""

    cache_k: tuple[jax.Array, ...]  # L × [B, S, K, D]
    cache_v: tuple[jax.Array, ...]
    tokens: jax.Array  # [B] int32, the token each slot feeds next
    positions: jax.Array  # [B] int32, that token's position (= its cache slot)
    counts: jax.Array  # [B] int32, tokens generated so far (the sampler's random stream index)
    sampling: SlotSampling  # [B] settings


def split_layers(params: dict, shardings: dict) -> tuple[dict, tuple[dict, ...]]:
    """(every weight but the stacked `layers`, one tree per layer): each layer's weights become their
    own buffers, so a decode step's matmuls read them in place (a slice of the stacked array is a
    copy on CPU, which multiplies the weight traffic of a step). Done once, on the devices, layer by layer."""
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    one = jax.tree.map(
        lambda sh: jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*sh.spec[1:])), shardings["layers"]
    )
    take = jax.jit(
        lambda tree, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree),
        out_shardings=one,
    )
    layers = tuple(take(stacked, np.int32(i)) for i in range(n))
    return {k: v for k, v in params.items() if k != "layers"}, layers


def _scatter_rows(x: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    return x.at[slots].set(rows.astype(x.dtype), mode="drop")  # padding rows carry slot B: dropped


class Steps:
    """The weights (split by layer), the decode state of `max_batch` slots over a `max_seq_len` cache,
    and the compiled prefill and decode steps. Takes the weights out of `model` (no second copy)."""

    def __init__(self, model: Any, max_batch: int, max_seq_len: int):
        self.placement = model.placement
        self.cfg = model.cfg
        self.mesh = self.placement.mesh
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.params = split_layers(model.params, self.placement.shardings)
        model.params = None  # the steps hold the weights split by layer now: no second copy
        self.state = self._empty_state()
        # Fixed layouts in and out, so the state a step returns is exactly what the next step expects.
        state_sh = jax.tree.map(lambda a: a.sharding, self.state)
        params_sh = jax.tree.map(lambda a: a.sharding, self.params)
        rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self._prefill = jax.jit(
            self._prefill_fn,
            donate_argnums=(1,),
            in_shardings=(params_sh, state_sh, rep, rep, rep, rep),
            out_shardings=(state_sh, rep),
        )
        self._decode = jax.jit(
            self._decode_fn,
            static_argnums=(2, 3),
            donate_argnums=(1,),
            in_shardings=(params_sh, state_sh),
            out_shardings=(state_sh, rep),
        )

    # ------------------------------------------------------------------------ running the steps

    def prefill(self, tokens, lengths, slots, settings: SlotSampling) -> jax.Array:
        """Dispatch a prefill; the first token of each prompt row [Bp] (on the device)."""
        self.state, first = self._prefill(self.params, self.state, tokens, lengths, slots, settings)
        return first

    def decode(self, rows: int, length: int) -> jax.Array:
        """Dispatch a decode step of the first `rows` slots; their next tokens [rows] (on the device)."""
        self.state, tokens = self._decode(self.params, self.state, rows, length)
        return tokens

    def compiled_shapes(self) -> int:
        """How many shapes are compiled (prefill buckets + decode buckets)."""
        return self._prefill._cache_size() + self._decode._cache_size()

    def wait(self) -> None:
        """Block until every dispatched step has run."""
        jax.block_until_ready(self.state)

    # ------------------------------------------------------------------------ jitted functions

    def _empty_state(self) -> DecodeState:
        cfg, B, S = self.cfg, self.max_batch, self.max_seq_len
        cache, heads = self.placement.cache_sharding(), self.placement.cache_heads()
        small = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

        def zeros(length):
            shape = (B, length, heads, cfg.head_dim)
            dtype = jnp.dtype(self.placement.policy.dtype)  # the cache holds keys and values in the compute dtype
            return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=cache)()

        host = (np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32), SlotSampling.empty(B))
        tokens, positions, counts, sampling = jax.device_put(host, small)
        lengths = cfg.cache_lengths(S)  # a local layer keeps a ring of its window
        return DecodeState(
            tuple(zeros(n) for n in lengths),
            tuple(zeros(n) for n in lengths),
            tokens,
            positions,
            counts,
            sampling,
        )

    def _prefill_fn(self, params, state: DecodeState, tokens, lengths, slots, settings: SlotSampling):
        """Run padded prompts [Bp, P], write their keys/values into cache rows `slots`, sample first tokens."""
        P = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), tokens.shape)
        with self._activate(decoding=False):
            logits, k, v = self._merge(params).prefill(tokens, positions, layers=params[1], select=lengths - 1)
        first = sample(logits[:, 0], settings, jnp.zeros_like(lengths))
        cache_k = tuple(_write_prompt(c, k[i], slots, lengths) for i, c in enumerate(state.cache_k))
        cache_v = tuple(_write_prompt(c, v[i], slots, lengths) for i, c in enumerate(state.cache_v))
        new = DecodeState(
            cache_k,
            cache_v,
            _scatter_rows(state.tokens, slots, first),
            _scatter_rows(state.positions, slots, lengths),
            _scatter_rows(state.counts, slots, jnp.ones_like(lengths)),
            SlotSampling(*(_scatter_rows(a, slots, b) for a, b in zip(state.sampling, settings))),
        )
        return new, first

    def _merge(self, params):
        """The model over (other weights, per-layer weights); its blocks come from `layers=`."""
        rest, layers = params
        return nnx.merge(self.placement.graphdef, {**rest, "layers": layers[0]})

    def _activate(self, decoding: bool):
        strategy = self.placement.strategy
        return sharding.activate(self.mesh, sharding.for_decoding(strategy) if decoding else strategy)

    def _decode_fn(self, params, state: DecodeState, rows: int, length: int):
        """The first `rows` slots advance one token, attending the first `length` slots of the cache
        (the rest of the state stays as it is). The tokens [rows] are returned."""
        with self._activate(decoding=True):
            logits, cache_k, cache_v = self._merge(params).decode(
                state.tokens[:rows, None],
                state.positions[:rows, None],
                state.cache_k,
                state.cache_v,
                layers=params[1],
                length=length,
            )
        nxt = sample(logits[:, 0], SlotSampling(*(a[:rows] for a in state.sampling)), state.counts[:rows])
        last = self.max_seq_len - 1  # idle slots run on harmlessly; keep their writes inside the cache
        new = DecodeState(
            cache_k,
            cache_v,
            state.tokens.at[:rows].set(nxt),
            state.positions.at[:rows].set(jnp.minimum(state.positions[:rows] + 1, last)),
            state.counts.at[:rows].add(1),
            state.sampling,
        )
        return new, nxt


def _write_prompt(cache, new, slots, lengths):
    """Prompt rows' keys or values [Bp, P, K, D] into cache rows `slots`. A cache shorter than the prompt
    is a local layer's ring: each of its S slots takes the newest position p < length with p = s mod S."""
    P, S = new.shape[1], cache.shape[1]
    if S >= P:
        return cache.at[slots, :P].set(new.astype(cache.dtype), mode="drop")
    held = cache_positions((lengths - 1)[:, None], S, S, ring=True)  # [Bp, S]; -1: empty, masked when decoding
    ring = jnp.take_along_axis(new, jnp.maximum(held, 0)[:, :, None, None], axis=1)
    return cache.at[slots].set(ring.astype(cache.dtype), mode="drop")


__all__ = ["DecodeState", "Steps", "split_layers"]
