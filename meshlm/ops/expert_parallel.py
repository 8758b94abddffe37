"""Expert parallelism: `moe_mlp` with the experts split over the `ep` mesh axis.

Tokens are split over the data axes and ep (outside MoE layers ep is one more data axis); each device
holds X / ep experts. A device routes its tokens, sorts the assignments by destination device, sends
them with `lax.all_to_all`, runs its experts with `ragged_dot` (`meshlm.ops.moe.grouped_mlp`), sends
the results back the same way and combines them into its tokens. XLA:CPU has no
`lax.ragged_all_to_all` (UNIMPLEMENTED in its thunk emitter), so the exchange uses fixed buffers of
N_local * k rows per destination (the dropless bound) whose empty rows carry no expert. Capacity,
the load and the auxiliary losses use global statistics, so every result equals one-device `moe_mlp`
on the whole batch. docs/moe.md, "Expert parallelism", gives the layouts.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshlm.ops.moe import (
    RouterStats,
    aux_outputs,
    combine,
    expert_capacity,
    grouped_mlp,
    kept_assignments,
    route,
    router_logits,
    router_stats,
    sort_by_expert,
)


class _Exchange(NamedTuple):
    """Static settings of one expert-parallel MoE call (hashable)."""

    ep_axis: str
    token_axes: tuple  # the data axes, then ep: the order tokens are laid out in
    ep: int
    num_experts: int
    k: int
    renormalize: bool
    capacity: int | None


def moe_mlp_ep(
    x, router_w, w_gate, w_up, w_down, *, mesh: Mesh, ep_axis: str = "ep", data_axes: tuple = (),
    k: int, renormalize: bool, capacity_factor: float | None = None, mask=None,
) -> tuple[jax.Array, dict]:  # fmt: skip
    """(y [N, E], aux) as `meshlm.ops.moe.moe_mlp`, in a `jax.shard_map` over `mesh`.

    x [N, E] and mask [N] are split over (*data_axes, ep_axis); router_w [E, X] is whole; w_gate,
    w_up [X, E, M] and w_down [X, M, E] are split over ep_axis on X. aux is the global batch's.
    """
    token_axes = (*data_axes, ep_axis)
    devices = math.prod(mesh.shape[a] for a in token_axes)
    ep, n, num_experts = mesh.shape[ep_axis], x.shape[0], router_w.shape[1]
    if num_experts % ep or n % devices:
        raise ValueError(f"{num_experts} experts and {n} tokens must divide by ep={ep} and {devices} token shards")
    capacity = None if capacity_factor is None else expert_capacity(capacity_factor, n, k, num_experts)
    settings = _Exchange(ep_axis, token_axes, ep, num_experts, k, renormalize, capacity)
    mask = jnp.ones((n,), jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32).reshape(n)
    tokens, experts = P(token_axes), P(ep_axis)
    sharded = jax.shard_map(
        functools.partial(_local_moe, settings), mesh=mesh,
        in_specs=(tokens, P(), experts, experts, experts, tokens), out_specs=(tokens, P()),
    )  # fmt: skip
    return sharded(x, router_w, w_gate, w_up, w_down, mask)


def _local_moe(s: _Exchange, x, router_w, w_gate, w_up, w_down, mask):
    """One device's part: route, send, run the local experts, send back, combine; global aux."""
    n = x.shape[0]
    logits = router_logits(x, router_w)
    weights, experts = route(logits, s.k, renormalize=s.renormalize)
    flat = experts.reshape(-1)
    valid = jnp.repeat(mask > 0, s.k)
    keep = kept_assignments(flat, valid, s.num_experts, s.capacity, _earlier_counts(s, flat, valid))
    order, _ = sort_by_expert(flat, keep, s.num_experts)
    dest, slot = _destinations(s, flat[order], keep[order])
    token_of_row = order // s.k
    received_x, received_ids = _send(s, x[token_of_row], flat[order] % (s.num_experts // s.ep), dest, slot)
    results = _run_local_experts(s, received_x, received_ids, w_gate, w_up, w_down)
    returned = lax.all_to_all(results, s.ep_axis, 0, 0, tiled=True)
    rows = returned.at[dest, slot].get(mode="fill", fill_value=0)
    y = combine(rows, token_of_row, jnp.where(keep, weights.reshape(-1), 0.0)[order], n)
    stats = RouterStats(*(lax.psum(v, s.token_axes) for v in router_stats(logits, experts, mask)))
    kept = lax.psum(jnp.sum(keep).astype(jnp.float32), s.token_axes)
    return y, aux_outputs(stats, kept, s.k)


def _earlier_counts(s: _Exchange, flat, valid):
    """[X] assignments the token shards before this one gave each expert (None when dropless)."""
    if s.capacity is None:
        return None
    local = jnp.bincount(jnp.where(valid, flat, s.num_experts), length=s.num_experts + 1)[: s.num_experts]
    every = lax.all_gather(local.astype(jnp.int32), s.token_axes)  # [devices, X] in token order
    me = lax.axis_index(s.token_axes)
    return jnp.sum(jnp.where((jnp.arange(every.shape[0]) < me)[:, None], every, 0), axis=0)


def _destinations(s: _Exchange, sorted_experts, sorted_keep):
    """(device [A], slot [A]) of each sorted assignment: device ep (out of range) for dropped ones."""
    dest = jnp.where(sorted_keep, sorted_experts // (s.num_experts // s.ep), s.ep)
    counts = jnp.bincount(dest, length=s.ep + 1)
    starts = jnp.cumsum(counts) - counts
    return dest, jnp.arange(dest.shape[0], dtype=jnp.int32) - starts[dest]


def _send(s: _Exchange, rows, local_ids, dest, slot):
    """Each assignment's token and local expert id to its device: ([ep * C, E], [ep * C]), C = N*k.

    Row j * C + i is the i-th row device j sent; empty rows carry the id X / ep (no expert).
    """
    capacity, width = rows.shape
    buffer = jnp.zeros((s.ep, capacity, width), rows.dtype).at[dest, slot].set(rows, mode="drop")
    ids = jnp.full((s.ep, capacity), s.num_experts // s.ep, jnp.int32).at[dest, slot].set(local_ids, mode="drop")
    received = lax.all_to_all(buffer, s.ep_axis, 0, 0, tiled=True)
    received_ids = lax.all_to_all(ids, s.ep_axis, 0, 0, tiled=True)
    return received.reshape(-1, width), received_ids.reshape(-1)


def _run_local_experts(s: _Exchange, rows, ids, w_gate, w_up, w_down):
    """[ep, C, E]: the local experts' outputs in the received rows' places (zero for empty rows)."""
    local_experts = s.num_experts // s.ep
    order, group_sizes = sort_by_expert(ids, ids < local_experts, local_experts)
    out = grouped_mlp(rows[order], group_sizes, w_gate, w_up, w_down)
    return jnp.zeros_like(out).at[order].set(out).reshape(s.ep, -1, rows.shape[-1])
