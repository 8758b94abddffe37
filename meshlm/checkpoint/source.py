"""The weight-reader interface: parameters somewhere, read as meshlm leaves, placed straight onto a mesh.

A `Source` knows its model (`cfg`), the files to carry along (`carried`: tokenizer, generation config) and
reads any leaf as whole blocks (one layer of a stacked leaf: what the writers stream) or as an arbitrary
slice (what one device holds). `Source.load` places each leaf into its `NamedSharding` with
`jax.make_array_from_callback`: each device's callback reads only its slice, so the whole model is never
gathered on one device or in one host buffer.

The readers: `hf_folder.HFSource`, `params_folder.ParamsSource`, `train_checkpoint.TrainCheckpoint`, and
`ArraySource` here (parameters already in memory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from meshlm.checkpoint.folders import carried_files
from meshlm.checkpoint.hf_map import Leaf, get_path, leaves, set_path
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig


class Source:
    """Parameters on disk, read as meshlm leaves: a whole block (one layer) or a slice of a leaf."""

    cfg: ModelConfig
    where: str
    carried: tuple[Path, ...] = ()  # tokenizer files and generation_config.json to copy along
    compute_dtype: str = "bfloat16"  # what `meshlm export` writes by default: a run's compute dtype where recorded

    def dtype(self, leaf: Leaf) -> np.dtype:
        raise NotImplementedError

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        """Layer `layer` of a stacked leaf (None: the whole unstacked leaf), in meshlm layout."""
        raise NotImplementedError

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        """leaf[index] in meshlm layout, reading little more than that slice."""
        raise NotImplementedError

    def load(self, placement) -> Any:
        """Every leaf placed into `placement.shardings`; each device's callback reads only its slice."""
        import jax

        shapes, shardings = placement.shapes, placement.shardings
        wanted = {_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
        have = {"/".join(leaf.path) for leaf in leaves(self.cfg)}
        if wanted != have:
            raise UsageError(f"{self.where}: parameters {sorted(have ^ wanted)[:3]} do not match this model's")
        params: dict[str, Any] = {}
        for leaf in leaves(self.cfg):
            target, sharding = get_path(shapes, leaf.path), get_path(shardings, leaf.path)
            if tuple(target.shape) != leaf.full_shape:
                raise UsageError(f"{self.where}: {leaf.name} is {leaf.full_shape} but this model needs {target.shape}")

            def read(index, leaf=leaf, dtype=target.dtype):
                return np.asarray(self.slice(leaf, index)).astype(dtype)

            set_path(params, leaf.path, jax.make_array_from_callback(target.shape, sharding, read))
            self.release()
        return params

    def release(self) -> None:
        """Drop open file mappings (their resident pages would otherwise add up to the whole file)."""

    def close(self) -> None:
        self.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class WholeLeafSource(Source):
    """A source that can only produce whole leaves (`whole_leaf`); the last one is kept, so reading a stacked
    leaf layer by layer fetches it once."""

    _cached: tuple[str, np.ndarray] | None = None

    def whole_leaf(self, leaf: Leaf) -> np.ndarray:
        raise NotImplementedError

    def _leaf(self, leaf: Leaf) -> np.ndarray:
        if self._cached is None or self._cached[0] != leaf.name:
            self._cached = None  # free the previous leaf before fetching the next
            self._cached = (leaf.name, np.asarray(self.whole_leaf(leaf)))
        return self._cached[1]

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        arr = self._leaf(leaf)
        return arr[layer] if layer is not None else arr

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        return self._leaf(leaf)[tuple(index)]

    def close(self) -> None:
        self._cached = None
        super().close()


class ArraySource(WholeLeafSource):
    """Parameters in memory (a pure dict of jax or numpy arrays), one leaf fetched to the host at a time."""

    def __init__(self, params: Any, cfg: ModelConfig, tokenizer_dir: str | Path | None = None):
        self.params, self.cfg, self.where = params, cfg, "parameters in memory"
        self.carried = carried_files(Path(tokenizer_dir)) if tokenizer_dir else ()

    def dtype(self, leaf: Leaf) -> np.dtype:
        return np.dtype(get_path(self.params, leaf.path).dtype)

    def whole_leaf(self, leaf: Leaf) -> np.ndarray:
        return np.asarray(get_path(self.params, leaf.path))


def slice_bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) per dimension of a basic-slicing index (missing trailing dims: the whole dim)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError("strided slices are not supported")
        out.append((start, stop))
    return out


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


__all__ = ["Source", "WholeLeafSource", "ArraySource", "slice_bounds"]
