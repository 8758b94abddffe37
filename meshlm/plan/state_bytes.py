"""Exact bytes per device of parameters, gradients and optimizer state on any mesh, without devices.

The model is traced once (`meshlm.models.placement.place` on an abstract mesh: shapes and logical
axes only), the optimizer state once (`jax.eval_shape` of `optimizer.init`). After that a mesh costs
only arithmetic: each leaf's local shard is its shape divided by the mesh axes that
`meshlm.sharding` assigns to its logical axes, exactly as `NamedSharding.shard_shape` computes it
for the real arrays. Optimizer moments follow their parameter's sharding and counters are
replicated, as in `meshlm.train.state.state_shardings`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from meshlm import sharding
from meshlm.mesh import AXES, MeshShape
from meshlm.models.configs import ModelConfig
from meshlm.models.policy import RunPolicy
from meshlm.strategy import DEFAULT


def abstract_mesh(shape: MeshShape) -> Any:
    """A device-free mesh of this shape (an AbstractMesh): enough for sharding arithmetic and for `place`,
    which take it where they take a Mesh."""
    return AbstractMesh(shape.sizes, AXES)


@dataclass(frozen=True)
class Leaf:
    """One array of the train state: its shape, element size and the logical axes it is sharded by."""

    shape: tuple[int, ...]
    itemsize: int
    logical: tuple | None  # logical axis names of the parameter this leaf follows; None: replicated


def local_elements(leaf: Leaf, sizes: dict[str, int], strategy: sharding.Strategy) -> int:
    """Elements of this leaf one device holds on a mesh of these axis sizes."""
    if leaf.logical is None:
        return math.prod(leaf.shape)
    spec = sharding.logical_to_spec(leaf.logical, strategy.params)
    n = 1
    for dim, entry in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        n *= dim // math.prod(sizes.get(a, 1) for a in axes)  # axes this mesh lacks (pp) shard nothing
    return n


class StateBytes:
    """Per-device bytes of the train state of one model and optimizer, for any mesh shape."""

    def __init__(
        self,
        cfg: ModelConfig,
        optimizer: optax.GradientTransformation,
        strategy: sharding.Strategy = DEFAULT,
        param_dtype: str = "float32",
    ):
        from meshlm.models.placement import place

        self.strategy = strategy
        self._memo: dict[tuple[int, MeshShape], int] = {}
        placement = place(cfg, abstract_mesh(MeshShape()), strategy, policy=RunPolicy(param_dtype=param_dtype))
        params, treedef = jax.tree.flatten(placement.shapes)
        logical = treedef.flatten_up_to(placement.logical)  # type: ignore[attr-defined]  # not in jax's stubs
        self.params = [Leaf(p.shape, np.dtype(p.dtype).itemsize, tuple(spec)) for p, spec in zip(params, logical)]
        index = jax.tree.unflatten(treedef, list(range(len(params))))
        opt_shapes = jax.eval_shape(optimizer.init, placement.shapes)
        follows = optax.tree_map_params(optimizer, lambda _, i: i, opt_shapes, index, transform_non_params=lambda _: -1)
        self.opt = [
            Leaf(s.shape, np.dtype(s.dtype).itemsize, self.params[i].logical if i >= 0 else None)
            for s, i in zip(jax.tree.leaves(opt_shapes), jax.tree.leaves(follows))
        ]

    def _bytes(self, leaves: list[Leaf], shape: MeshShape) -> int:
        key = (id(leaves), shape)  # a search asks for the same meshes once per remat policy
        if key not in self._memo:
            sizes = shape.as_dict()
            self._memo[key] = sum(local_elements(leaf, sizes, self.strategy) * leaf.itemsize for leaf in leaves)
        return self._memo[key]

    def params_bytes(self, shape: MeshShape) -> int:
        return self._bytes(self.params, shape)

    def grads_bytes(self, shape: MeshShape) -> int:
        """Gradients have their parameter's shape, dtype and (after reduction) sharding."""
        return self.params_bytes(shape)

    def optimizer_bytes(self, shape: MeshShape) -> int:
        return self._bytes(self.opt, shape)


@lru_cache(maxsize=8)
def _state_bytes(cfg: ModelConfig, optimizer_key: str = "adamw", param_dtype: str = "float32") -> StateBytes:
    """Cached `StateBytes` for a model with meshlm's optimizer (AdamW, clipping as `meshlm train`)."""
    from meshlm.optimizer import OptimizerConfig, make_optimizer

    return StateBytes(cfg, make_optimizer(OptimizerConfig()), param_dtype=param_dtype)


def state_bytes(cfg: ModelConfig, optimizer_key: str = "adamw", param_dtype: str = "float32") -> StateBytes:
    """`_state_bytes` for the model's weights stored in `param_dtype` (the run policy's other fields change
    no state)."""
    return _state_bytes(cfg, optimizer_key, param_dtype)


def real_bytes_per_device(tree) -> int:
    """Bytes that device 0 holds of a pytree of real (or abstract, sharded) arrays: the test's ground truth."""
    total = 0
    for x in jax.tree.leaves(tree):
        total += math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


__all__ = ["StateBytes", "state_bytes", "abstract_mesh", "real_bytes_per_device", "P"]
