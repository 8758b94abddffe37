"""LoRA: low-rank adapters trained on top of frozen base weights.

    lora = place_lora(placement, LoraSpec(rank=8, alpha=16))   # which weights, adapter shapes and layouts
    adapters = lora.init(seed=0)                                 # A random, B zero: the base model, unchanged
    logits = placement.apply(lora.merge(base, adapters), tokens)

A targeted weight W (a parameter whose path `--lora_targets` matches) gets A [in, r] and B [r, out] and
the model runs W + (alpha / r)·A·B. A weight's *input* axes are those `x @ W` contracts (wq [E, H, D]: E;
wo [H, D, E]: H and D), so the adapter is exactly the one a Hugging Face Linear layer with the weight
[out, in] would get: A = lora_A.weightᵀ, B = lora_B.weightᵀ, with the in and out axes flattened in
order. The adapters keep their weight's logical axes on either side of a `lora_rank` axis (wq's A is
("layers", "embed", "lora_rank"), its B ("layers", "lora_rank", "heads", "head_dim")), so the same
strategy tables lay them out; `lora_rank` is always whole. Training merges each layer's adapters
inside the layer scan (`Placement.stream(..., extra=, adapt=)`; docs/lora.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshlm import sharding
from meshlm.axes import LORA_RANK
from meshlm.errors import UsageError
from meshlm.models.lora_options import DEFAULT_TARGETS, check_lora
from meshlm.models.placement import Placement
from meshlm.strategy.rules import flatten, resolve, unflatten

# The weights LoRA can adapt, by leaf name: how many leading axes (after a stacked leaf's `layers`) are
# the projection's input.
IN_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "gate": 1, "up": 1, "down": 1, "lm_head": 1}


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float = 16.0
    targets: str = DEFAULT_TARGETS
    base_dtype: str = "float32"  # the frozen base weights' dtype (bfloat16 halves their memory)

    def __post_init__(self):
        if self.rank <= 0:
            raise UsageError(f"--lora_rank={self.rank} must be a positive integer (0 turns LoRA off)")
        check_lora(self.rank, self.alpha, self.targets, self.base_dtype)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def meta(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": self.targets, "base_dtype": self.base_dtype}


def canonical_path(path: str, placement: Placement) -> str:
    """A placement path without its layer-group key: layers/0-1/attn/wq -> layers/attn/wq."""
    for g in placement.groups:
        if path.startswith(f"layers/{g.key}/"):
            return "layers/" + path[len(f"layers/{g.key}/") :]
    return path


def find_targets(placement: Placement, spec: LoraSpec) -> dict[str, int]:
    """{placement path: input axes} of every parameter `spec.targets` matches (searched in the path
    without its layer-group key); a match that is no projection, or none at all, is a UsageError."""
    out = {}
    paths = list(flatten(placement.logical))
    for path in paths:
        canon = canonical_path(path, placement)
        if not re.search(spec.targets, canon):
            continue
        name = canon.rsplit("/", 1)[-1]
        if name not in IN_AXES:
            raise UsageError(
                f"--lora_targets={spec.targets!r} matches {canon}, which is not a projection; match only "
                f"{', '.join(IN_AXES)} (e.g. the default {DEFAULT_TARGETS!r})"
            )
        out[path] = IN_AXES[name]
    if not out:
        canon = sorted({canonical_path(p, placement) for p in paths})
        raise UsageError(
            f"--lora_targets={spec.targets!r} matches no parameter; the paths look like "
            f"{', '.join(c for c in canon if c.rsplit('/', 1)[-1] in IN_AXES)}"
        )
    return out


def _split(logical: tuple, shape: tuple, in_axes: int, rank: int, lead: int):
    """(A's logical axes and shape, B's) for a weight with these axes; `lead`: 1 for a stacked weight."""
    cut = lead + in_axes
    a = ((*logical[:cut], LORA_RANK), (*shape[:cut], rank))
    b = ((*logical[:lead], LORA_RANK, *logical[cut:]), (*shape[:lead], rank, *shape[cut:]))
    return a, b


@dataclass(frozen=True, eq=False)
class LoraPlacement:
    """The adapters of a placed model: which weights, their adapters' shapes and layouts on the mesh.

    Adapter trees mirror the parameter tree, a targeted leaf replaced by {"a": A, "b": B}."""

    spec: LoraSpec
    base: Placement
    targets: dict[str, int]  # placement path -> the weight's input axes
    logical: Any
    shapes: Any
    specs: Any
    grad_specs: Any
    opt_specs: Any

    @cached_property
    def shardings(self) -> Any:
        return sharding.named(self.base.mesh, self.specs)

    @cached_property
    def grad_shardings(self) -> Any:
        return sharding.named(self.base.mesh, self.grad_specs)

    @cached_property
    def opt_shardings(self) -> Any:
        return sharding.named(self.base.mesh, self.opt_specs)

    @cached_property
    def base_shapes(self) -> Any:
        """The frozen base parameters' shapes, in `spec.base_dtype`."""
        dt = jnp.dtype(self.spec.base_dtype)
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), self.base.shapes)

    def cast_base(self, params: Any) -> Any:
        dt = jnp.dtype(self.spec.base_dtype)
        return jax.tree.map(lambda a: a.astype(dt), params)

    def random(self, seed: int = 0) -> Any:
        """Traceable: A uniform in ±1/√fan_in (fan_in: the weight's input size), B zero. The same values on
        every mesh and layer grouping for the same seed."""
        key = jax.random.fold_in(jax.random.key(seed), 0x10A)
        shapes = flatten(jax.eval_shape(self.base.canonical, self.base.shapes))
        targets = sorted({canonical_path(p, self.base): n for p, n in self.targets.items()}.items())
        canon: dict[str, Any] = {}
        for i, (path, in_axes) in enumerate(targets):
            lead = int(path.startswith("layers/"))
            (_, a), (_, b) = _split(("layers",) * lead, tuple(shapes[path].shape), in_axes, self.spec.rank, lead)
            bound = 1.0 / math.sqrt(math.prod(a[lead:-1]))
            canon[f"{path}/a"] = jax.random.uniform(jax.random.fold_in(key, i), a, jnp.float32, -bound, bound)
            canon[f"{path}/b"] = jnp.zeros(b, jnp.float32)
        return self.base.grouped(unflatten(canon))

    def init(self, seed: int = 0) -> Any:
        """Fresh adapters, created already sharded."""
        return jax.jit(lambda: self.random(seed), out_shardings=self.shardings)()

    def merge(self, base: Any, adapters: Any) -> Any:
        """Traceable: the parameter (sub)tree with each adapted weight W replaced by W + scale·A·B (in the
        adapters' dtype); leaves without adapters are returned as they are."""
        return merge_tree(base, adapters, self.spec.scale)

    def loss_sums(self, placement: Placement, base: Any, adapters: Any, batch: dict):
        """`meshlm.train.step.loss_sums` with adapters: the embedding and head weights merged up front, each
        layer's inside the layer scan. `placement` is `self.base` or a variant of it (same tree)."""
        top = merge_tree(
            {k: v for k, v in base.items() if k != "layers"},
            {k: v for k, v in adapters.items() if k != "layers"},
            self.spec.scale,
        )
        params = {**top, "layers": base["layers"]}
        x = placement.stream(
            params,
            batch["inputs"],
            batch["positions"],
            batch["segment_ids"],
            extra=adapters.get("layers"),
            adapt=lambda w, e: merge_tree(w, e, self.spec.scale),
        )
        with sharding.activate(placement.mesh, placement.strategy):
            return placement.structure.head_loss(x, batch["targets"], batch["loss_mask"], params)

    def n_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.shapes))


def _is_adapter(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {"a", "b"} and not isinstance(node["a"], dict)


def merge_tree(base: Any, adapters: Any, scale: float) -> Any:
    if adapters is None:
        return base
    out = dict(base)
    for key, node in adapters.items():
        out[key] = (
            merged_weight(base[key], node["a"], node["b"], scale)
            if _is_adapter(node)
            else merge_tree(base[key], node, scale)
        )
    return out


def merged_weight(w, a, b, scale: float):
    """W + scale·A·B in A's dtype, contracting the rank axis; a leading stacked-layers axis is kept
    (batched). The one merge of LoRA: traced on jax arrays (training, serving), on the host for numpy
    ones (an export reads and merges one layer at a time)."""
    lead = a.ndim + b.ndim - 2 - w.ndim
    if isinstance(a, np.ndarray) and lead == 0:
        delta = np.tensordot(a, b, axes=([-1], [0]))
    else:
        n_in, n_out = a.ndim - 1 - lead, b.ndim - 1 - lead
        letters = "abcdefghijklmnopq"
        L, I, O = letters[:lead], letters[lead : lead + n_in], letters[lead + n_in : lead + n_in + n_out]
        delta = (np if isinstance(a, np.ndarray) else jnp).einsum(f"{L}{I}z,{L}z{O}->{L}{I}{O}", a, b)
    return w.astype(a.dtype) + scale * delta


def place_lora(placement: Placement, spec: LoraSpec) -> LoraPlacement:
    """Find the targeted weights and lay out their adapters by each weight's strategy table (the same
    tables as the weights; `lora_rank` whole). [[rules]] of `--sharding_rules` apply to weights only."""
    if placement.policy.param_dtype != "float32":
        raise UsageError(
            "LoRA adapters train in float32: use --param_dtype=float32 (--lora_base_dtype=bfloat16 "
            "keeps the frozen base in bfloat16)"
        )
    targets = find_targets(placement, spec)
    flat_logical, flat_shapes = flatten(placement.logical), flatten(placement.shapes)
    logical, shapes = {}, {}
    for path, in_axes in targets.items():
        names = tuple(flat_logical[path])
        s = flat_shapes[path]
        (la, sa), (lb, sb) = _split(names, tuple(s.shape), in_axes, spec.rank, int(names[:1] == ("layers",)))
        logical[f"{path}/a"], logical[f"{path}/b"] = la, lb
        shapes[f"{path}/a"] = jax.ShapeDtypeStruct(sa, jnp.float32)
        shapes[f"{path}/b"] = jax.ShapeDtypeStruct(sb, jnp.float32)

    def strategy_of(path: str):
        for g in placement.groups:
            if path.startswith(f"layers/{g.key}/"):
                return g.strategy, f"table {g.strategy.name} (layers {g.key})"
        return placement.strategy, f"table {placement.strategy.name}"

    resolved = resolve(logical, {p: tuple(s.shape) for p, s in shapes.items()}, strategy_of, None, placement.mesh)
    specs, grads, opt = (unflatten(resolved.specs[w]) for w in ("params", "grads", "opt_state"))
    return LoraPlacement(
        spec,
        placement,
        targets,
        unflatten({p: P(*n) for p, n in logical.items()}),
        unflatten(shapes),
        specs,
        grads,
        opt,
    )


__all__ = ["LoraSpec", "LoraPlacement", "place_lora", "merge_tree", "merged_weight", "DEFAULT_TARGETS", "IN_AXES"]
