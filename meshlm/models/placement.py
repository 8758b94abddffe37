"""A model placed on a mesh: its structure, the sharding of every parameter, init and apply.

    placement = place(cfg, mesh)                 # nothing allocated yet
    params = placement.init(seed=0)              # each device creates only its own shards
    logits = placement.apply(params, tokens)     # inside jit: activations constrained on the mesh

Parameters are plain nested dicts of arrays (`{"layers": {"attn": {"wq": ...}}}`), the same tree for
training, checkpoints and weight conversion.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from meshlm import sharding
from meshlm.models.configs import ModelConfig
from meshlm.models.llama import Llama


def _build(cfg: ModelConfig, seed: int) -> Llama:
    with nnx.use_eager_sharding(False):  # logical names only; placement happens through jit out_shardings
        return Llama(cfg, nnx.Rngs(seed))


@dataclass(frozen=True, eq=False)
class Placement:
    cfg: ModelConfig
    mesh: Mesh
    strategy: sharding.Strategy
    graphdef: Any
    logical: Any  # pure dict of logical PartitionSpecs, e.g. P('layers', 'embed', 'mlp')
    specs: Any  # pure dict of mesh PartitionSpecs, e.g. P(None, 'fsdp', 'tp')
    shapes: Any  # pure dict of jax.ShapeDtypeStruct

    @cached_property
    def shardings(self) -> Any:
        return sharding.named(self.mesh, self.specs)

    @cached_property
    def abstract(self) -> Any:
        """ShapeDtypeStructs carrying their shardings: for ahead-of-time compilation and restore targets."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.shapes, self.shardings)

    def random_params(self, seed: int = 0) -> Any:
        """Traceable: random parameters as a pure dict. Same values on every mesh for the same seed."""
        return nnx.to_pure_dict(nnx.state(_build(self.cfg, seed), nnx.Param))

    def init(self, seed: int = 0) -> Any:
        """Random parameters, created already sharded: each device computes only its own shards."""
        return jax.jit(lambda: self.random_params(seed), out_shardings=self.shardings)()

    def apply(self, params: Any, tokens: jax.Array, positions=None, segment_ids=None, **kw) -> jax.Array:
        """Logits [B, T, V] float32 (see `Llama.__call__` for `return_kv` and `select`). Call under jit."""
        with sharding.activate(self.mesh, self.strategy):
            return nnx.merge(self.graphdef, params)(tokens, positions, segment_ids, **kw)

    def decode(self, params: Any, tokens, positions, cache_k, cache_v):
        """One cached decode step (see `Llama.decode`), laid out by the strategy's decoding variant."""
        with sharding.activate(self.mesh, sharding.for_decoding(self.strategy)):
            return nnx.merge(self.graphdef, params).decode(tokens, positions, cache_k, cache_v)

    def cache_sharding(self) -> jax.sharding.NamedSharding:
        """Layout of one layer's KV cache [B, S, K, D]."""
        spec = sharding.logical_to_spec(("batch", "cache_length", "kv_heads", "head_dim"),
                                        self.strategy.activations, self.mesh)
        return jax.sharding.NamedSharding(self.mesh, spec)

    def param_bytes_per_device(self) -> int:
        total = 0
        for shape, sh in zip(jax.tree.leaves(self.shapes), jax.tree.leaves(self.shardings)):
            local = sh.shard_shape(shape.shape)
            n = 1
            for d in local:
                n *= d
            total += n * shape.dtype.itemsize
        return total


def place(cfg: ModelConfig, mesh: Mesh, strategy: sharding.Strategy = sharding.DEFAULT) -> Placement:
    """Trace the model abstractly and shard each parameter by the strategy's table."""
    abstract = nnx.eval_shape(lambda: _build(cfg, 0))
    graphdef, state = nnx.split(abstract, nnx.Param)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)
    specs = sharding.param_specs(logical, strategy, mesh, jax.tree.map(lambda s: s.shape, shapes))
    return Placement(cfg, mesh, strategy, graphdef, logical, specs, shapes)
