"""Choosing the next token: greedy, temperature, top-k, top-p, per request, inside the jitted step.

Every row of a decode batch carries its own settings (a request's `SamplingParams`), so requests
with different settings share one compiled step. A row's random stream depends only on its seed
and on how many tokens it has generated, never on which other requests share the batch: the same
seed gives the same text whether a request runs alone or among thirty others. Seeds are any signed
64-bit integer, each with its own stream (`seed_key`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
SEED_RANGE = (-(2**63), 2**63)  # OpenAI's: a signed 64-bit integer


def seed_key(seed: int) -> np.ndarray:
    """The PRNG key data (threefry: two uint32 words) of a seed in SEED_RANGE: its 64 bits, high word
    first, as `jax.random.key` lays out a 64-bit seed. Distinct seeds give distinct keys, and a seed in
    [0, 2^32) the key `jax.random.key(seed)` makes; built on the host, with no device work."""
    bits = seed % 2**64  # two's complement: -1 is 2^64 - 1, beyond what a non-negative seed can be
    return np.array([bits >> 32, bits & 0xFFFFFFFF], np.uint32)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a number >= 0 (0 is greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 is off), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2^63, 2^63), got {self.seed!r}")


class SlotSampling(NamedTuple):
    """Per-row sampling settings as device arrays [B] (keys [B, 2])."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array

    @staticmethod
    def host(params: list[SamplingParams], fallback_seeds: list[int]) -> SlotSampling:
        """Numpy arrays for these requests (a request without a seed uses its fallback seed)."""
        seeds = [p.seed if p.seed is not None else s for p, s in zip(params, fallback_seeds)]
        return SlotSampling(
            np.array([min(p.temperature, FLOAT32_MAX) for p in params], np.float32),  # 1e308 is as good as infinite
            np.array([p.top_k for p in params], np.int32),
            np.array([p.top_p for p in params], np.float32),
            np.stack([seed_key(s) for s in seeds]) if seeds else np.zeros((0, 2), np.uint32),
        )

    @staticmethod
    def empty(batch: int) -> SlotSampling:
        return SlotSampling(
            np.zeros(batch, np.float32),
            np.zeros(batch, np.int32),
            np.ones(batch, np.float32),
            np.zeros((batch, 2), np.uint32),
        )


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sort each row [B, V] descending and mask (to -inf) what top-k and top-p exclude.

    Returns (masked sorted logits, the token id of each sorted position). The most likely token
    always survives, so no row is left with nothing to sample."""
    vocab = logits.shape[-1]
    order = jnp.argsort(-logits, axis=-1)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    ranked = jnp.where(keep, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly ahead of each token
    keep = keep & ((before < top_p[:, None]) | (rank == 0))
    return jnp.where(keep, ranked, -jnp.inf), order


def sample(logits: jax.Array, settings: SlotSampling, counts: jax.Array) -> jax.Array:
    """Next token ids [B] int32 from float32 logits [B, V]; `counts` [B] is tokens generated so far.

    The sort behind top-k/top-p runs only when some row asks for a filter, the random draw only when
    some row has temperature > 0: an all-greedy batch is a bare argmax."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        temperature = jnp.maximum(settings.temperature, 1e-6)[:, None]
        scaled = logits / temperature
        needs_filter = jnp.any((settings.top_k > 0) | (settings.top_p < 1))
        ranked, order = jax.lax.cond(
            needs_filter,
            lambda x: filter_logits(x, settings.top_k, settings.top_p),
            lambda x: (x, jnp.broadcast_to(jnp.arange(x.shape[-1]), x.shape)),
            scaled,
        )
        keys = jax.vmap(lambda k, n: jax.random.fold_in(jax.random.wrap_key_data(k), n))(settings.keys, counts)
        choice = jax.vmap(jax.random.categorical)(keys, ranked)
        drawn = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(settings.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(settings.temperature > 0), draw, lambda _: greedy, None)


__all__ = ["SEED_RANGE", "seed_key", "SamplingParams", "SlotSampling", "filter_logits", "sample"]
