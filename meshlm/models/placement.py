"""A model placed on a mesh: its structure, the sharding of every parameter, init and apply.

    placement = place(cfg, mesh)                 # nothing allocated yet
    params = placement.init(seed=0)              # each device creates only its own shards
    logits = placement.apply(params, tokens)     # inside jit: activations constrained on the mesh

Parameters are plain nested dicts of arrays (`{"layers": {"attn": {"wq": ...}}}`), the same tree for
training, checkpoints and weight conversion. With per-layer-range strategies (`[[layers]]` in a
`--sharding_rules` file) the stacked layers are split into groups, `{"layers": {"0-15": ..., "16-31": ...}}`,
each laid out by its own strategy and run as its own scan (`Decoder.run_layers` on the group's weights);
`canonical` joins them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshlm import axes, sharding
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig
from meshlm.models.decoder import Decoder
from meshlm.models.policy import DEFAULT_POLICY, RunPolicy
from meshlm.strategy.presets import DEFAULT
from meshlm.strategy.rules import LayerGroup, Rules, flatten, resolve, unflatten


def _build(cfg: ModelConfig, policy: RunPolicy, seed: int) -> Decoder:
    with nnx.use_eager_sharding(False):  # logical names only; placement happens through jit out_shardings
        return Decoder(cfg, policy, nnx.Rngs(seed))


@dataclass(frozen=True, eq=False)
class Placement:
    cfg: ModelConfig
    mesh: Mesh
    strategy: sharding.Strategy
    graphdef: Any
    logical: Any  # pure dict of logical PartitionSpecs, e.g. P('layers', 'embed', 'mlp')
    specs: Any  # pure dict of mesh PartitionSpecs, e.g. P(None, 'fsdp', 'tp')
    shapes: Any  # pure dict of jax.ShapeDtypeStruct
    grad_specs: Any = None  # where gradients live (ZeRO stage 2+ shards them); None: as specs
    opt_specs: Any = None  # where optimizer moments live (ZeRO stage 1+ shards them); None: as specs
    sources: Any = None  # {"layers/mlp/gate": "table default", ...}: what produced each spec
    groups: tuple[LayerGroup, ...] = ()  # per-layer-range strategies; () when the layers are one stack
    policy: RunPolicy = DEFAULT_POLICY  # how the model runs: dtypes, remat, attention kernel, loss chunks

    @cached_property
    def shardings(self) -> Any:
        return sharding.named(self.mesh, self.specs)

    @property
    def platform(self) -> str:
        """The platform ("cpu", "gpu", "tpu") of the mesh's devices (a TPU topology's on a CPU host)."""
        return self.mesh.devices.flat[0].platform

    @property
    def gradient_specs(self) -> Any:
        """The PartitionSpecs the gradients live in: `grad_specs`, or the parameters' own."""
        return self.grad_specs if self.grad_specs is not None else self.specs

    @cached_property
    def grad_shardings(self) -> Any:
        return sharding.named(self.mesh, self.gradient_specs)

    @cached_property
    def opt_shardings(self) -> Any:
        return sharding.named(self.mesh, self.opt_specs if self.opt_specs is not None else self.specs)

    def strategies(self) -> list[sharding.Strategy]:
        return [self.strategy, *(g.strategy for g in self.groups)]

    @cached_property
    def abstract(self) -> Any:
        """ShapeDtypeStructs carrying their shardings: for ahead-of-time compilation and restore targets."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.shapes, self.shardings
        )

    def random_params(self, seed: int = 0) -> Any:
        """Traceable: random parameters as a pure dict. Same values on every mesh (and grouping) for the same seed."""
        return self.grouped(nnx.to_pure_dict(nnx.state(_build(self.cfg, self.policy, seed), nnx.Param)))

    def grouped(self, params: Any) -> Any:
        """The one-stack tree -> this placement's tree (layer groups split off; the same tree without groups)."""
        if not self.groups:
            return params
        layers = params["layers"]
        return {
            **params,
            "layers": {g.key: jax.tree.map(lambda a, g=g: a[g.start : g.stop], layers) for g in self.groups},
        }

    def canonical(self, params: Any) -> Any:
        """This placement's tree -> the one-stack tree of checkpoints and weight conversion."""
        if not self.groups:
            return params
        parts = [params["layers"][g.key] for g in self.groups]
        return {**params, "layers": jax.tree.map(lambda *a: jnp.concatenate(a), *parts)}

    def init(self, seed: int = 0) -> Any:
        """Random parameters, created already sharded: each device computes only its own shards."""
        return jax.jit(lambda: self.random_params(seed), out_shardings=self.shardings)()

    def apply(self, params: Any, tokens: jax.Array, positions=None, segment_ids=None, **kw) -> jax.Array:
        """Logits [B, T, V] float32 (see `Decoder.__call__` for `return_kv` and `select`). Call under jit."""
        if self.groups:
            if kw:
                raise UsageError("per-layer-range strategies ([[layers]]) are for training; serve with one strategy")
            return self._apply_groups(params, tokens, positions, segment_ids)
        with sharding.activate(self.mesh, self.strategy):
            return nnx.merge(self.graphdef, params)(tokens, positions, segment_ids, **kw)

    @cached_property
    def structure(self) -> Decoder:
        """The model without weights (abstract): its parts run on parameter trees given to them."""
        return nnx.eval_shape(lambda: _build(self.cfg, self.policy, 0))

    def stream(
        self, params: Any, tokens: jax.Array, positions=None, segment_ids=None, extra=None, adapt=None
    ) -> jax.Array:
        """The residual stream [B, T, E] after the last layer (embedding and layers, not the head).

        The embedding runs under the main strategy; without layer groups the layers do too, with them
        each group is scanned under its own strategy, and at a boundary the stream moves from one
        group's layout to the next one's (XLA reshards it). `extra` (a tree shaped like `params["layers"]`,
        e.g. LoRA adapters) is scanned along with the layers and `adapt(layer, extra_layer)` makes each
        layer's weights inside the scan. Call under jit."""
        model = self.structure

        def run(x, positions, layers, more, first=0):
            if adapt is None:
                return model.run_layers(x, positions, segment_ids, layers, first=first)[0]
            return model.run_layers(x, positions, segment_ids, (layers, more), adapt=lambda p: adapt(*p), first=first)[
                0
            ]

        with sharding.activate(self.mesh, self.strategy):
            x, positions = model.embed_tokens(tokens, positions, params)
            if not self.groups:
                return run(x, positions, params["layers"], extra)
        for before, group in zip((None, *self.groups), self.groups):
            with sharding.activate(self.mesh, group.strategy):
                if before is not None:  # the residual stream moves to this group's layout here
                    with jax.named_scope(f"boundary {before.key}>{group.key}"):
                        x = sharding.constrain(x, axes.STREAM)
                with jax.named_scope(f"layers {group.key}"):
                    more = None if extra is None else extra[group.key]
                    x = run(x, positions, params["layers"][group.key], more, group.start)
        return x

    def _apply_groups(self, params, tokens, positions, segment_ids):
        """Logits with per-layer-range strategies: `stream`, then the head under the main strategy."""
        x = self.stream(params, tokens, positions, segment_ids)
        with sharding.activate(self.mesh, self.strategy):
            return self.structure.head(x, params)

    def decode(self, params: Any, tokens, positions, cache_k, cache_v):
        """One cached decode step (see `Decoder.decode`), laid out by the strategy's decoding variant."""
        with sharding.activate(self.mesh, sharding.for_decoding(self.strategy)):
            return nnx.merge(self.graphdef, params).decode(tokens, positions, cache_k, cache_v)

    def cache_sharding(self) -> jax.sharding.NamedSharding:
        """Layout of one layer's KV cache [B, S, K, D]."""
        spec = sharding.logical_to_spec(axes.KV_CACHE, self.strategy.activations, self.mesh)
        return jax.sharding.NamedSharding(self.mesh, spec)

    def cache_heads(self) -> int:
        """kv heads in one layer's KV cache: the model's, times the copies the decode layout needs when
        tp is larger than the kv heads (`sharding.kv_head_copies`)."""
        cfg = self.cfg
        with sharding.activate(self.mesh, sharding.for_decoding(self.strategy)):
            return cfg.n_kv_heads * sharding.kv_head_copies(cfg.n_kv_heads, cfg.n_heads)

    def param_bytes_per_device(self) -> int:
        total = 0
        for shape, sh in zip(jax.tree.leaves(self.shapes), jax.tree.leaves(self.shardings)):
            local = sh.shard_shape(shape.shape)
            n = 1
            for d in local:
                n *= d
            total += n * shape.dtype.itemsize
        return total


def place(
    cfg: ModelConfig,
    mesh: Mesh,
    strategy: sharding.Strategy = DEFAULT,
    rules: Rules | None = None,
    policy: RunPolicy = DEFAULT_POLICY,
) -> Placement:
    """Trace the model abstractly and lay out each parameter (and its gradient and optimizer moments)
    by its strategy's tables, then by the first matching rule (`meshlm.strategy`). `policy`: how the
    model runs (its parameters' dtype among it)."""
    abstract = nnx.eval_shape(lambda: _build(cfg, policy, 0))
    graphdef, state = nnx.split(abstract, nnx.Param)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)
    groups = rules.groups(cfg.n_layers, strategy) if rules else ()
    if groups:
        logical = {**logical, "layers": {g.key: logical["layers"] for g in groups}}
        shapes = {
            **shapes,
            "layers": {
                g.key: jax.tree.map(
                    lambda s, n=g.stop - g.start: jax.ShapeDtypeStruct((n, *s.shape[1:]), s.dtype), shapes["layers"]
                )
                for g in groups
            },
        }

    def strategy_of(path: str) -> tuple[sharding.Strategy, str]:
        for g in groups:
            if path.startswith(f"layers/{g.key}/"):
                return g.strategy, f"table {g.strategy.name} (layers {g.key})"
        return strategy, f"table {strategy.name}"

    flat_shapes = {p: tuple(s.shape) for p, s in flatten(shapes).items()}
    resolved = resolve({p: tuple(s) for p, s in flatten(logical).items()}, flat_shapes, strategy_of, rules, mesh)
    specs, grad_specs, opt_specs = (unflatten(resolved.specs[w]) for w in ("params", "grads", "opt_state"))
    return Placement(
        cfg, mesh, strategy, graphdef, logical, specs, shapes, grad_specs, opt_specs, resolved.sources, groups, policy
    )
