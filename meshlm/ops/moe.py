"""Mixture-of-experts math on one device: routing, the auxiliary losses and the dropless expert MLP.

`route` picks each token's top-k experts from a float32 softmax over the router logits (renormalised
over the k or not). `moe_mlp` runs the gated (SwiGLU) experts without a [tokens, experts, d] dispatch
tensor: the N*k (token, expert) assignments are sorted by expert, the tokens gathered, each expert's
rows multiplied by its weights with `jax.lax.ragged_dot`, scaled by the routing weights and added back.
A `capacity_factor` bounds each expert's assignments (the rest are dropped and counted). The
load-balancing and z losses are built from summed statistics (`RouterStats`) so that
`meshlm.ops.expert_parallel` can reduce them over devices first. Shapes: N tokens, E d_model, X
experts, M the experts' hidden size, k experts per token. docs/moe.md explains the math and layouts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


def route(logits: jax.Array, k: int, *, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] float32, experts [N, k] int32): each token's k most probable experts.

    The softmax is taken in float32 over all X experts; with `renormalize` the k weights are divided
    by their sum (Mixtral; Qwen3-MoE's `norm_topk_prob`), otherwise they stay softmax probabilities.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def token_mask(mask: jax.Array | None, n: int) -> jax.Array:
    """[N] float32: 1 for the tokens that count, 0 for padding; all ones without a mask."""
    return jnp.ones((n,), jnp.float32) if mask is None else mask.reshape(n).astype(jnp.float32)


# --------------------------------------------------------------------------------------------
# Auxiliary losses from summed statistics
# --------------------------------------------------------------------------------------------


class RouterStats(NamedTuple):
    """Sums over the counted tokens, reducible over devices with `psum` before the losses are taken."""

    counts: jax.Array  # [X] float32: top-k assignments per expert
    prob_sums: jax.Array  # [X] float32: router probabilities summed over tokens
    z_sum: jax.Array  # [] float32: logsumexp(logits)^2 summed over tokens
    tokens: jax.Array  # [] float32: tokens counted


def router_stats(logits: jax.Array, experts: jax.Array, mask: jax.Array | None = None) -> RouterStats:
    """The sums behind both losses for logits [N, X] and chosen experts [N, k]; `mask` [N] drops padding."""
    n, num_experts = logits.shape
    m = token_mask(mask, n)
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32).sum(axis=1)  # [N, X]
    lse = jax.nn.logsumexp(logits, axis=-1)
    return RouterStats(
        counts=jnp.einsum("n,nx->x", m, chosen), prob_sums=jnp.einsum("n,nx->x", m, probs),
        z_sum=jnp.sum(m * lse**2), tokens=jnp.sum(m),
    )  # fmt: skip


def balance_loss_from_stats(stats: RouterStats) -> jax.Array:
    """X * sum_x f_x * P_x, f the assignments per counted token and P the mean probability (Switch)."""
    num_experts = stats.counts.shape[0]
    fraction = stats.counts / stats.tokens
    return num_experts * jnp.sum(fraction * stats.prob_sums / stats.tokens)


def z_loss_from_stats(stats: RouterStats) -> jax.Array:
    """The mean over counted tokens of logsumexp(logits)^2 (ST-MoE's router z-loss)."""
    return stats.z_sum / stats.tokens


def load_balancing_loss(logits, experts, num_experts: int, k: int, mask=None) -> jax.Array:
    """The auxiliary load-balancing loss of logits [N, X] whose top-k choices are experts [N, k].

    num_experts * sum over experts of (assignments / counted tokens) * (mean router probability);
    a balanced router scores k. `mask` [N] (1 = real token) leaves padding out of both means.
    """
    if logits.shape[-1] != num_experts or experts.shape[-1] != k:
        raise ValueError(f"logits {logits.shape} / experts {experts.shape} do not match {num_experts} experts, k={k}")
    return balance_loss_from_stats(router_stats(logits, experts, mask))


def router_z_loss(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """mean(logsumexp(logits)^2) over the counted tokens of logits [N, X]."""
    m = token_mask(mask, logits.shape[0])
    return jnp.sum(m * jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2) / jnp.sum(m)


# --------------------------------------------------------------------------------------------
# Capacity and the sorted assignments
# --------------------------------------------------------------------------------------------


def expert_capacity(capacity_factor: float, tokens: int, k: int, num_experts: int) -> int:
    """ceil(capacity_factor * tokens * k / num_experts): the most assignments one expert keeps."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, not {capacity_factor}")
    return math.ceil(capacity_factor * tokens * k / num_experts)


def positions_in_expert(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """[A] int32: how many earlier entries of the flat `expert_ids` [A] chose the same expert.

    Ids outside [0, num_experts) get positions too but count towards no expert in range.
    """
    order = jnp.argsort(expert_ids, stable=True)
    sorted_ids = expert_ids[order]
    counts = jnp.bincount(expert_ids, length=num_experts + 1)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(expert_ids.shape[0], dtype=jnp.int32) - starts[sorted_ids]
    return jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)


def kept_assignments(expert_ids, valid, num_experts: int, capacity: int | None, offsets=None) -> jax.Array:
    """[A] bool: which flat assignments (token-major: token 0's k choices, then token 1's, ...) run.

    Invalid ones (padding) never run. With a `capacity` an expert keeps its first `capacity` valid
    assignments in that order, after `offsets` [X] (assignments earlier devices gave it) if given.
    """
    if capacity is None:
        return valid
    ids = jnp.where(valid, expert_ids, num_experts)
    before = positions_in_expert(ids, num_experts)
    if offsets is not None:
        before = before + jnp.concatenate([offsets, jnp.zeros((1,), offsets.dtype)])[ids]
    return valid & (before < capacity)


class Sorted(NamedTuple):
    """Assignments sorted by expert; the dropped ones last, beyond every group."""

    order: jax.Array  # [A] int32: the flat assignment at each sorted row
    group_sizes: jax.Array  # [X] int32: kept rows per expert, in expert order


def sort_by_expert(expert_ids: jax.Array, keep: jax.Array, num_experts: int) -> Sorted:
    """Stable sort of flat assignments [A] by expert, the ones not kept moved to the end."""
    key = jnp.where(keep, expert_ids, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return Sorted(order, group_sizes)


# --------------------------------------------------------------------------------------------
# The experts
# --------------------------------------------------------------------------------------------


def grouped_mlp(rows, group_sizes, w_gate, w_up, w_down, activation=jax.nn.silu) -> jax.Array:
    """down(act(rows @ gate) * (rows @ up)) with each expert's weights on its group of rows.

    rows [R, E] sorted by expert, group_sizes [X] (rows past their sum come out zero), w_gate and
    w_up [X, E, M], w_down [X, M, E]; float32 accumulation, the result in the rows' dtype.
    """
    f32 = jnp.float32
    gate = lax.ragged_dot(rows, w_gate, group_sizes, preferred_element_type=f32)
    up = lax.ragged_dot(rows, w_up, group_sizes, preferred_element_type=f32)
    hidden = (activation(gate) * up).astype(rows.dtype)
    return lax.ragged_dot(hidden, w_down, group_sizes, preferred_element_type=f32).astype(rows.dtype)


def router_logits(x: jax.Array, router_w: jax.Array) -> jax.Array:
    """[N, X] float32 logits of tokens x [N, E] under the router weight [E, X]."""
    return jnp.einsum("ne,ex->nx", x, router_w, preferred_element_type=jnp.float32)


def combine(expert_out, token_of_row, weight_of_row, n: int) -> jax.Array:
    """[N, E]: each row's output scaled by its routing weight, summed into its token (float32 sum)."""
    scaled = expert_out.astype(jnp.float32) * weight_of_row[:, None]
    out = jnp.zeros((n, expert_out.shape[-1]), jnp.float32).at[token_of_row].add(scaled)
    return out.astype(expert_out.dtype)


def aux_outputs(stats: RouterStats, kept: jax.Array, k: int) -> dict:
    """The aux dict from global router statistics and the global number of kept assignments."""
    assigned = stats.tokens * k
    return {
        "load": stats.counts,
        "dropped_fraction": jnp.where(assigned > 0, 1.0 - kept / jnp.maximum(assigned, 1.0), 0.0),
        "load_balancing_loss": balance_loss_from_stats(stats),
        "z_loss": z_loss_from_stats(stats),
    }


def moe_mlp(
    x, router_w, w_gate, w_up, w_down, *, k: int, renormalize: bool,
    capacity_factor: float | None = None, mask=None,
) -> tuple[jax.Array, dict]:  # fmt: skip
    """(y [N, E], aux): the routed gated-SiLU experts applied to tokens x [N, E].

    router_w [E, X], w_gate and w_up [X, E, M], w_down [X, M, E]. Dropless when `capacity_factor` is
    None; otherwise each expert keeps its first ceil(c * N * k / X) assignments in token-major order
    (token 0's choices, then token 1's, ...) and the rest add nothing. `mask` [N] (1 = real token)
    keeps padding out of the experts (its output is zero) and out of every statistic. aux: `load` [X]
    routed assignments per expert, `dropped_fraction`, `load_balancing_loss`, `z_loss`.
    """
    n, num_experts = x.shape[0], router_w.shape[1]
    logits = router_logits(x, router_w)
    weights, experts = route(logits, k, renormalize=renormalize)
    valid = jnp.repeat(token_mask(mask, n) > 0, k)
    flat_experts = experts.reshape(-1)
    capacity = None if capacity_factor is None else expert_capacity(capacity_factor, n, k, num_experts)
    keep = kept_assignments(flat_experts, valid, num_experts, capacity)
    order, group_sizes = sort_by_expert(flat_experts, keep, num_experts)
    token_of_row = order // k
    out = grouped_mlp(x[token_of_row], group_sizes, w_gate, w_up, w_down)
    y = combine(out, token_of_row, jnp.where(keep, weights.reshape(-1), 0.0)[order], n)
    stats = router_stats(logits, experts, mask)
    return y, aux_outputs(stats, jnp.sum(keep).astype(jnp.float32), k)
