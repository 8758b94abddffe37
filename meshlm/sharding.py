"""Where logical axes live on the mesh: the mechanism (tables -> PartitionSpecs, activation constraints).
With `meshlm.strategy` (the named tables and the user's overrides), the only code that knows mesh axis names.

The model names what each dimension *means* (`batch`, `length`, `embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `vocab`, `layers`: `meshlm.axes`); a `Strategy` says where each meaning goes on the
(dp, fsdp, tp, sp) mesh, with one table for parameters and one for activations (a weight's `embed`
dimension is sharded for memory, an activation's is not). XLA propagates everything in between.

    with sharding.activate(mesh, strategy):   # model code inside can call constrain() / ring_spec()
        ...
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.axes import KEYS, QUERIES, TOKENS
from meshlm.errors import UsageError

MeshAxes = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Strategy:
    """One sharding strategy: logical axis -> mesh axes, separately for parameters and activations."""

    name: str
    params: Mapping[str, MeshAxes]
    activations: Mapping[str, MeshAxes]
    doc: str = ""
    # Where gradients and optimizer state live (ZeRO stages, `meshlm.strategy.zero`); None: as params.
    grads: Mapping[str, MeshAxes] | None = None
    opt_state: Mapping[str, MeshAxes] | None = None
    # Activation axes that give their mesh axes up to another dimension of the same array that claims
    # them (Megatron sequence parallelism: `length` over tp, except where heads or mlp take tp).
    shared: frozenset[str] = frozenset()
    zero_stage: int | None = None  # the --zero_stage applied to this table, for messages

    def table(self, what: str) -> Mapping[str, MeshAxes]:
        """The logical table for `params`, `grads`, `opt_state` or `activations`."""
        return getattr(self, what) if getattr(self, what) is not None else self.params

    def data_axes(self, mesh: Mesh) -> tuple[str, ...]:
        """The mesh axes (of size > 1) the batch is split over: the axes ZeRO shards state over."""
        return tuple(a for a in _as_tuple(self.activations.get("batch")) if mesh.shape.get(a, 1) > 1)


def for_decoding(strategy: Strategy) -> Strategy:
    """The strategy for decode steps: a step's few new tokens stay whole (they cannot split over sp);
    the KV cache keeps its `cache_length` split, so each sp rank scores its own slice of the context."""
    return dataclasses.replace(
        strategy, name=f"{strategy.name}+decode", activations={**strategy.activations, "length": None}
    )


def as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    """A table entry (None, one mesh axis or several) as a tuple of mesh axes."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


_as_tuple = as_tuple


def logical_to_spec(
    logical: Sequence[str | None],
    table: Mapping[str, MeshAxes],
    mesh: Mesh | None = None,
    shared: frozenset[str] = frozenset(),
) -> P:
    """Map logical axis names to a PartitionSpec. Mesh axes of size 1, or absent from the mesh (pp
    without a pipeline), are dropped: they shard nothing. A `shared` logical axis gives up a mesh axis
    that another dimension of the same array claims; any other clash is an error."""
    per_dim = []
    for name in logical:
        if name is not None and name not in table:
            raise UsageError(f"logical axis {name!r} has no entry in the sharding table; known: {', '.join(table)}")
        axes = () if name is None else _as_tuple(table[name])
        per_dim.append(tuple(a for a in axes if mesh is None or mesh.shape.get(a, 1) > 1))
    claimed = {a for name, axes in zip(logical, per_dim) if name not in shared for a in axes}
    entries, used = [], set()
    for name, axes in zip(logical, per_dim):
        if name in shared:
            axes = as_tuple(filter_axes(axes, drop=claimed))
        if clash := used.intersection(axes):
            raise UsageError(f"logical axes {tuple(logical)} put mesh axis {sorted(clash)[0]!r} on two dimensions")
        used.update(axes)
        entries.append(filter_axes(axes))
    return P(*entries)


def spec_divides(spec: P, shape: Sequence[int], mesh: Mesh) -> str | None:
    """The first dimension that the spec's mesh axes do not divide, as a message, or None."""
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        ways = math.prod(mesh.shape[a] for a in _as_tuple(axes))
        if size % ways:
            return f"dimension {dim} of size {size} is not divisible by {'×'.join(_as_tuple(axes))} = {ways}"
    return None


# --------------------------------------------------------------------------------------- parameters


def _ways(entry: MeshAxes, mesh: Mesh) -> int:
    return math.prod(mesh.shape.get(a, 1) for a in _as_tuple(entry))


def replicate_short_kv_heads(spec: P, logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """`spec` with the `kv_heads` dimension whole where its mesh axes do not divide it (tp larger than a
    grouped-query model's kv heads): each device then holds every kv head's projection and the model
    repeats the heads it needs (`kv_head_copies`). Any other dimension is left for `spec_divides` to judge."""
    entries = list(tuple(spec) + (None,) * (len(shape) - len(spec)))
    for dim, name in enumerate(logical):
        if name == "kv_heads" and shape[dim] % _ways(entries[dim], mesh):
            entries[dim] = None
    return P(*entries)


def kv_head_copies(n_kv_heads: int, n_heads: int) -> int:
    """How many copies of each kv head the active layout needs so that keys and values split over the
    `kv_heads` mesh axes as evenly as the queries do: 1 when those axes divide the kv heads (or outside
    `activate`), else the fewest copies that make them divide (tp = 8 on 2 kv heads: 4 copies, one per
    tp rank; how vLLM and others run such models)."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    ways = _ways(activation_spec(("kv_heads",))[0], active.mesh)
    if n_kv_heads % ways == 0:
        return 1
    copies = math.lcm(n_kv_heads, ways) // n_kv_heads
    if n_heads % (n_kv_heads * copies):
        raise UsageError(
            f"{n_heads} query heads do not split over the {ways} ways the mesh splits heads; "
            f"choose a tp that divides {n_heads}"
        )
    return copies


def param_specs(
    logical_specs: Any, strategy: Strategy, mesh: Mesh, shapes: Any | None = None, what: str = "params"
) -> Any:
    """Pytree of logical PartitionSpecs (from `nnx.get_partition_spec`) -> pytree of mesh PartitionSpecs,
    by the strategy's table for `what` (params, grads or opt_state)."""

    def one(path, logical, shape=None):
        spec = logical_to_spec(tuple(logical), strategy.table(what), mesh)
        if shape is not None:
            spec = replicate_short_kv_heads(spec, tuple(logical), shape, mesh)
        if shape is not None and (problem := spec_divides(spec, shape, mesh)):
            raise UsageError(
                f"parameter {jax.tree_util.keystr(path)} {tuple(shape)}: {problem}; choose another mesh_dim"
            )
        return spec

    is_leaf = lambda x: isinstance(x, P)  # noqa: E731
    if shapes is None:
        return jax.tree_util.tree_map_with_path(one, logical_specs, is_leaf=is_leaf)
    return jax.tree_util.tree_map_with_path(one, logical_specs, shapes, is_leaf=is_leaf)


def named(mesh: Mesh, specs: Any) -> Any:
    """PartitionSpecs -> NamedShardings on this mesh."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# --------------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class _Active:
    mesh: Mesh
    strategy: Strategy


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("meshlm_sharding", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh, strategy: Strategy):
    """Within this block (while tracing), `constrain` and `ring_spec` use this mesh and strategy."""
    token = _ACTIVE.set(_Active(mesh, strategy))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def activation_spec(logical: Sequence[str | None]) -> P | None:
    active = _ACTIVE.get()
    if active is None:
        return None
    return logical_to_spec(logical, active.strategy.activations, active.mesh, active.strategy.shared)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout at a key operator; a no-op outside `activate`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    return _pin(x, logical_to_spec(logical, active.strategy.activations, active.mesh, active.strategy.shared), active)


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """`jnp.take(table, tokens, axis=0)`: rows [B, T, E] of the [V, E] embedding table, laid out for the mesh
    (the caller pins the result's own layout). Plain `take` outside `activate`.

    The table is stored with its embed dimension split over some mesh axes (fsdp and sp in the default
    strategy). Rather than gather the table to every device, the token ids are gathered over those axes:
    each device looks up its own columns of the table for every token of the devices that share its
    shard, and the rows then move home one mesh axis at a time (an all-to-all each), taking each axis
    off the minor end of the embed dimension to the batch or length dimension that holds it in the
    activations. Per device this moves B·T/n rows instead of the [V, E] table, and the table's gradient
    needs no reduction over those axes. A table axis that no token dimension takes back (a user's rule)
    keeps the table gathered instead, and so does a lookup inside a `shard_map` (pipeline stages, ZeRO
    0-2), whose partly manual layouts XLA's partitioner cannot move this way."""
    active = _ACTIVE.get()
    if active is None:
        return jnp.take(table, tokens, axis=0)
    mesh, strategy = active.mesh, active.strategy
    table_axes = [a for a in _as_tuple(strategy.params.get("embed")) if mesh.shape.get(a, 1) > 1]
    batch, length = (list(_as_tuple(e)) for e in logical_to_spec(TOKENS, strategy.activations, mesh, strategy.shared))
    if not table_axes or _manual_context() is not None or any(a not in batch and a not in length for a in table_axes):
        gathered = logical_to_spec(("vocab", "embed"), strategy.activations, mesh, strategy.shared)
        return jnp.take(_pin(table, gathered, active), tokens, axis=0)
    rows_batch, rows_length = [a for a in batch if a not in table_axes], [a for a in length if a not in table_axes]
    x = jnp.take(table, _pin(tokens, P(filter_axes(rows_batch), filter_axes(rows_length)), active), axis=0)
    x = _pin(x, P(filter_axes(rows_batch), filter_axes(rows_length), filter_axes(table_axes)), active)
    embed = list(table_axes)
    while embed:
        axis = embed.pop()
        if axis in batch:
            rows_batch = [a for a in batch if a in rows_batch or a == axis]
        else:
            rows_length = [a for a in length if a in rows_length or a == axis]
        x = _pin(x, P(filter_axes(rows_batch), filter_axes(rows_length), filter_axes(embed)), active)
    return x


def filter_axes(
    axes: MeshAxes | Sequence[str], *, drop: Collection[str] = (), only: Collection[str] | None = None
) -> MeshAxes:
    """Mesh axes (a table or spec entry, or a sequence of axes) as one PartitionSpec entry (None, one
    axis, or a tuple of them), keeping those in `only` (all when None) and not in `drop`."""
    kept = tuple(a for a in as_tuple(axes) if a not in drop and (only is None or a in only))
    return None if not kept else kept[0] if len(kept) == 1 else kept


def filter_spec(spec: P, *, drop: Collection[str] = (), only: Collection[str] | None = None) -> P:
    """`spec` with each entry's mesh axes filtered as `filter_axes` does."""
    return P(*(filter_axes(e, drop=drop, only=only) for e in spec))


def without_axes(strategy: Strategy, axes: Collection[str]) -> Strategy:
    """The strategy's activations without these mesh axes (inside a shard_map that is manual over them)."""
    acts = {k: filter_axes(v, drop=axes) for k, v in strategy.activations.items()}
    return dataclasses.replace(strategy, activations=acts)


def micro_batches(batch: dict, n: int, mesh: Mesh | None = None, strategy: Strategy | None = None) -> dict:
    """Each [B, ...] array of `batch` -> [n, B/n, ...], micro-batch i = rows i, i+n, ...: each data shard
    keeps its own rows. With `mesh` and `strategy`, the rows stay laid out as the strategy's batch."""
    stacked = None if mesh is None else NamedSharding(mesh, P(None, *batch_sharding(mesh, strategy).spec))

    def split(x):
        x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
        return x if stacked is None else jax.lax.with_sharding_constraint(x, stacked)

    return {k: split(v) for k, v in batch.items()}


def _pin(x: jax.Array, spec: P, active: _Active) -> jax.Array:
    context = _manual_context()
    if context is not None:  # inside a shard_map (pipeline stages, ZeRO 0-2): its mesh, its automatic axes only
        manual = set(context.manual_axes)
        return jax.lax.with_sharding_constraint(x, NamedSharding(context, filter_spec(spec, drop=manual)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(active.mesh, spec))


def _manual_context():
    """The mesh of the `shard_map` being traced when it is manual over some axes, else None."""
    context = jax.sharding.get_abstract_mesh()
    return context if not context.empty and context.manual_axes else None


def splits_over(specs: Any, axes: Sequence[str]) -> bool:
    """Whether any PartitionSpec in the tree `specs` splits a dimension over one of these mesh axes."""
    wanted = set(axes)
    return any(
        wanted.intersection(_as_tuple(e))
        for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        for e in spec
    )


def global_norm(tree: Any, mesh: Mesh, specs: Any) -> jax.Array:
    """The L2 norm over every element of `tree` (float32), laid out by `specs` on `mesh`, with one
    reduction across devices for the whole tree. (Left to XLA's partitioner, each array's sum of squares
    is reduced on its own: one collective per leaf, and the step waits on every one of them.) Each
    device sums the squares of its own shards; a leaf held whole on some mesh axes is counted once by
    dividing its sum by the copies those axes make (a power of two on every real mesh: exact)."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    if _manual_context() is not None or not spec_leaves or mesh.size == 1:
        return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))
    copies = [mesh.size // math.prod(mesh.shape[a] for e in s for a in _as_tuple(e)) for s in spec_leaves]

    def local(*leaves):
        partial = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) / c for x, c in zip(leaves, copies))
        return jax.lax.psum(partial, tuple(mesh.axis_names))

    fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(spec_leaves), out_specs=P(), check_vma=False)
    return jnp.sqrt(fn(*jax.tree.leaves(tree)))


def batch_sharding(mesh: Mesh, strategy: Strategy, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length, ...] input array."""
    logical = TOKENS + (None,) * (ndim - 2)
    return NamedSharding(mesh, logical_to_spec(logical[:ndim], strategy.activations, mesh, strategy.shared))


@dataclass(frozen=True)
class RingSpec:
    """What RingAttention needs to run over the sequence axis: the mesh, the axis and the array layouts."""

    mesh: Mesh
    axis_name: str
    size: int
    qkv_spec: P  # [batch, length, heads, head_dim]
    seq_spec: P  # [batch, length]
    order: str | None = None  # the tokens' order over the ring ("zigzag", "contiguous"); None: not known


def data_parallel_size(mesh: Mesh, strategy: Strategy) -> int:
    """How many ways the strategy's `batch` activation axis splits the rows on this mesh."""
    return math.prod(mesh.shape.get(a, 1) for a in _as_tuple(strategy.activations.get("batch")))


def sequence_parallel_size(mesh: Mesh, strategy: Strategy) -> int:
    """How many ways RingAttention splits the sequence (1: no ring; a `shared` length never rings)."""
    if "length" in strategy.shared:
        return 1
    return math.prod(mesh.shape[a] for a in _as_tuple(strategy.activations.get("length")))


def ring_spec() -> RingSpec | None:
    """The ring layout when the active strategy splits `length` over the mesh, else None."""
    active = _ACTIVE.get()
    if active is None or "length" in active.strategy.shared:
        return None
    axes = [a for a in _as_tuple(active.strategy.activations.get("length")) if active.mesh.shape[a] > 1]
    if not axes:
        return None
    if len(axes) > 1:
        raise UsageError(
            f"strategy {active.strategy.name!r} splits length over {axes}; RingAttention needs one mesh axis"
        )
    table = active.strategy.activations
    # Inside a shard_map that is manual over other axes (ZeRO stages 0-2 over the data axes), the ring's
    # own shard_map must name the context's mesh, whose types say which axes are already manual.
    context = _manual_context()
    return RingSpec(
        mesh=active.mesh if context is None else context,
        axis_name=axes[0],
        size=active.mesh.shape[axes[0]],
        qkv_spec=logical_to_spec(QUERIES, table, active.mesh),
        seq_spec=logical_to_spec(TOKENS, table, active.mesh),
        order=_TOKEN_ORDER.get(),
    )


_TOKEN_ORDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshlm_token_order", default=None)


@contextlib.contextmanager
def token_order(order: str | None):
    """Within this block (while tracing), a split sequence's tokens lie in this order over the ring:
    "zigzag" (training and evaluation permute their batches so), "contiguous" (serving), or None (not
    known: RingAttention then runs the kernel that masks by position, whatever the order)."""
    token = _TOKEN_ORDER.set(order)
    try:
        yield
    finally:
        _TOKEN_ORDER.reset(token)


@dataclass(frozen=True)
class KernelLayout:
    """Where a fused attention kernel runs shard by shard: the mesh being traced, the layouts of its
    [batch, length, heads, head_dim] inputs and [batch, length] positions, and the devices' platform."""

    mesh: Any  # the active Mesh, or the abstract mesh of the shard_map being traced
    q_spec: P
    kv_spec: P
    seq_spec: P
    platform: str


def kernel_layout() -> KernelLayout | None:
    """The layout for a per-shard attention kernel under `activate` (None outside it): batch and heads
    split as the strategy says, the sequence whole (a split sequence goes to `ring_spec`)."""
    active = _ACTIVE.get()
    if active is None:
        return None
    q, kv = activation_spec(QUERIES), activation_spec(KEYS)
    return KernelLayout(
        mesh=_manual_context() or active.mesh,
        q_spec=P(q[0], None, q[2], None),
        kv_spec=P(kv[0], None, kv[2], None),
        seq_spec=P(q[0], None),
        platform=active.mesh.devices.flat[0].platform,
    )


def active_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices the model is traced for: the active mesh's
    (a TPU topology compiled on a CPU host is "tpu"), else that of the devices JAX runs on."""
    active = _ACTIVE.get()
    return (active.mesh.devices.flat[0] if active is not None else jax.devices()[0]).platform


def describe_specs(specs: Any) -> list[tuple[str, str]]:
    """(path, PartitionSpec) rows for logs and tests."""
    rows = []
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]:
        rows.append((jax.tree_util.keystr(path), str(spec)))
    return rows


__all__ = [
    "Strategy",
    "for_decoding",
    "logical_to_spec",
    "param_specs",
    "named",
    "replicated",
    "activate",
    "constrain",
    "activation_spec",
    "batch_sharding",
    "RingSpec",
    "ring_spec",
    "data_parallel_size",
    "sequence_parallel_size",
    "KernelLayout",
    "kernel_layout",
    "active_platform",
    "describe_specs",
    "filter_axes",
    "filter_spec",
    "without_axes",
    "micro_batches",
]
