"""Parameters out of a training checkpoint: `meshlm export` (params only, compute dtype, for serving).

A training checkpoint (`Checkpointer`, manager.py) holds the whole train state: step, params and optimizer
moments (3x the params with Adam). Export reads only the params, one leaf at a time, with an Orbax partial
restore into host memory (peak: the largest stacked leaf, e.g. [L, E, M] in the param dtype), casts each to
the compute dtype and streams it into a meshlm params folder (`params.safetensors` + `config.json` +
`tokenizer/` from the run's output_dir), the format `hf.load_params` places straight onto any mesh.

`--checkpoint` may name a run's output_dir (it holds checkpoints/), the checkpoints/ folder itself
(newest complete step), or one step's folder (checkpoints/120).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.checkpoint.hf import Leaf, Source, _get, carried_files, leaves, open_source, write_params
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, RopeScaling


def _is_step_dir(p: Path) -> bool:
    return p.is_dir() and p.name.isdigit() and (p / "state").is_dir()


def is_train_checkpoint(p: Path) -> bool:
    """A run's output_dir, a Checkpointer folder or one step of it."""
    if not p.is_dir():
        return False
    if (p / "checkpoints").is_dir() or _is_step_dir(p):
        return True
    return any(_is_step_dir(c) for c in p.iterdir())


def find_checkpoint(path: str | Path, step: int | None = None) -> tuple[Path, int, Path | None]:
    """(Checkpointer folder, step, run output_dir or None) for any of the three accepted spellings."""
    from meshlm.checkpoint.manager import Checkpointer

    p = Path(path).expanduser().absolute()
    if _is_step_dir(p):
        directory, step = p.parent, int(p.name) if step is None else step
    elif (p / "checkpoints").is_dir():
        directory = p / "checkpoints"
    elif is_train_checkpoint(p):
        directory = p
    else:
        raise UsageError(f"--checkpoint={p} holds no training checkpoint; pass a run's output_dir or its checkpoints/")
    if step is None:
        ckpt = Checkpointer(directory, async_save=False)
        step = ckpt.latest_step()
        ckpt.close()
        if step is None:
            raise UsageError(f"--checkpoint={p}: no complete checkpoint in {directory}")
    if not _is_step_dir(directory / str(step)):
        raise UsageError(f"--checkpoint={p}: there is no step {step} in {directory}")
    run_dir = directory.parent if directory.name == "checkpoints" else None
    return directory, step, run_dir


def config_from_meta(model: dict) -> ModelConfig:
    """The ModelConfig saved in a checkpoint's meta["model"] (dataclasses.asdict form)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in model.items() if k in known}
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelConfig(**fields)


class TrainCheckpoint(Source):
    """The params of one step of a training checkpoint, restored leaf by leaf (or straight onto a mesh)."""

    def __init__(self, path: str | Path, step: int | None = None):
        import orbax.checkpoint as ocp

        from meshlm.checkpoint.manager import Checkpointer

        directory, self.step, run_dir = find_checkpoint(path, step)
        self.where = str(directory / str(self.step))
        ckpt = Checkpointer(directory, async_save=False)
        try:
            meta = ckpt.meta(self.step)
        except Exception as e:  # noqa: BLE001  (unreadable metadata: a broken checkpoint)
            raise UsageError(
                f"checkpoint {self.where} has unreadable metadata ({type(e).__name__}); pass another step"
            ) from None
        finally:
            ckpt.close()
        if "model" not in meta:
            raise UsageError(f"checkpoint {self.where} records no model config; it was not written by meshlm train")
        self.cfg = config_from_meta(meta["model"])
        self.state_dir = directory / str(self.step) / "state"
        self._ckptr = ocp.PyTreeCheckpointer()
        try:
            tree = ocp.PyTreeCheckpointHandler().metadata(self.state_dir)
            self._stored = getattr(tree, "tree", tree)["params"]
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"checkpoint {self.where} has unreadable state ({type(e).__name__}); pass another step") from None
        for leaf in leaves(self.cfg):
            try:
                shape = tuple(_get(self._stored, leaf.path).shape)
            except (KeyError, TypeError):
                raise UsageError(f"checkpoint {self.where} has no parameter {leaf.name}") from None
            if shape != leaf.full_shape:
                raise UsageError(f"checkpoint {self.where}: {leaf.name} has shape {shape}, expected {leaf.full_shape}")
        self.carried = carried_files(run_dir / "tokenizer") if run_dir is not None else ()
        self._cached: tuple[str, np.ndarray] | None = None

    def dtype(self, leaf: Leaf) -> np.dtype:
        return np.dtype(_get(self._stored, leaf.path).dtype)

    def _restore(self, item: dict, restore_args: dict) -> dict:
        import orbax.checkpoint as ocp

        args = ocp.args.PyTreeRestore(
            item={"params": item}, restore_args={"params": restore_args}, partial_restore=True
        )
        try:
            return self._ckptr.restore(self.state_dir, args=args)["params"]
        except Exception as e:  # noqa: BLE001  (truncated or corrupt files surface as many error types)
            first = (str(e).splitlines() or [""])[0][:200]
            raise UsageError(
                f"checkpoint {self.where} is incomplete or corrupt ({type(e).__name__}: {first}); pass another step"
            ) from None

    def _leaf(self, leaf: Leaf) -> np.ndarray:
        """One whole leaf in host memory; the last one is kept so per-layer reads restore it once."""
        import orbax.checkpoint as ocp

        if self._cached is None or self._cached[0] != leaf.name:
            self._cached = None
            item, args = {}, {}
            _put(item, leaf.path, 0)
            _put(args, leaf.path, ocp.RestoreArgs(restore_type=np.ndarray))
            self._cached = (leaf.name, np.asarray(_get(self._restore(item, args), leaf.path)))
        return self._cached[1]

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        arr = self._leaf(leaf)
        return arr[layer] if layer is not None else arr

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        return self._leaf(leaf)[tuple(index)]

    def load(self, placement) -> Any:
        """Orbax reads each device's shards straight into `placement.shardings` (cast to the param dtype)."""
        import orbax.checkpoint as ocp

        abstract = placement.abstract
        return self._restore(abstract, ocp.checkpoint_utils.construct_restore_args(abstract))

    def close(self) -> None:
        self._cached = None
        self._ckptr.close()


class ArraySource(Source):
    """Parameters in memory (a pure dict of jax or numpy arrays), one leaf fetched to the host at a time."""

    def __init__(self, params: Any, cfg: ModelConfig, tokenizer_dir: str | Path | None = None):
        self.params, self.cfg, self.where = params, cfg, "parameters in memory"
        self.carried = carried_files(Path(tokenizer_dir)) if tokenizer_dir else ()
        self._cached: tuple[str, np.ndarray] | None = None

    def dtype(self, leaf: Leaf) -> np.dtype:
        return np.dtype(_get(self.params, leaf.path).dtype)

    def _leaf(self, leaf: Leaf) -> np.ndarray:
        if self._cached is None or self._cached[0] != leaf.name:
            self._cached = None
            self._cached = (leaf.name, np.asarray(_get(self.params, leaf.path)))
        return self._cached[1]

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        arr = self._leaf(leaf)
        return arr[layer] if layer is not None else arr

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        return self._leaf(leaf)[tuple(index)]


def export_params(checkpoint: str | Path, out: str | Path, dtype: str | None = None, step: int | None = None) -> Path:
    """`meshlm export --checkpoint=D --out=P`: params only, in the model's compute dtype unless `dtype` is given."""
    with open_source(checkpoint, step) as source:
        return write_params(source, out, dtype or source.cfg.dtype, flag="--out")


def save_params(
    params: Any, cfg: ModelConfig, out: str | Path, dtype: str | None = None, tokenizer_dir: str | Path | None = None
) -> Path:
    """Write in-memory parameters (single process) as a meshlm params folder."""
    return write_params(ArraySource(params, cfg, tokenizer_dir), out, dtype)


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


__all__ = ["export_params", "save_params", "find_checkpoint", "is_train_checkpoint", "TrainCheckpoint", "ArraySource"]
