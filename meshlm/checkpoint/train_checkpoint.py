"""The parameters of a training checkpoint (`manager.Checkpointer`), read as a weight source.

A training checkpoint holds the whole train state: step, params and optimizer moments (3x the params with
Adam). `TrainCheckpoint` reads only the params: leaf by leaf into host memory with an Orbax partial restore
(for export and convert: one whole leaf at a time, e.g. a stacked [L, E, M]), or every device's shards
straight into their shardings (`load`).

A checkpoint may be named by a run's output_dir (it holds checkpoints/), the checkpoints/ folder itself
(newest complete step) or one step's folder (checkpoints/120). Orbax, and with it jax, is imported only
when a checkpoint is opened.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.checkpoint import checksums
from meshlm.checkpoint.folders import TOKENIZER_DIR, carried_files
from meshlm.checkpoint.hf_map import Leaf, get_path, leaves, set_path
from meshlm.checkpoint.source import WholeLeafSource
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, RopeScaling
from meshlm.models.policy import RunPolicy, from_saved


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
        ckpt = Checkpointer(directory, async_save=False, read_only=True)
        step = ckpt.latest_step()
        ckpt.close()
        if step is None:
            raise UsageError(f"--checkpoint={p}: no complete checkpoint in {directory}")
    if not _is_step_dir(directory / str(step)):
        steps = complete_steps(directory)
        have = f"the steps there are {', '.join(map(str, steps))}" if steps else "it holds no complete step"
        raise UsageError(f"--checkpoint={p}: there is no step {step} in {directory}; {have}")
    run_dir = directory.parent if directory.name == "checkpoints" else None
    return directory, step, run_dir


def complete_steps(directory: Path) -> list[int]:
    """The steps of a Checkpointer folder that were saved completely, oldest first."""
    return sorted(int(c.name) for c in directory.iterdir() if _is_step_dir(c)) if directory.is_dir() else []


def another_step(directory: Path, step: int) -> str:
    """What to pass instead of a broken `step`: the newest other step whose files verify."""
    others = [s for s in complete_steps(directory) if s != step]
    if not others:
        return "it is the only checkpoint there, so there is no other --step to pass"
    good = checksums.newest_verifying(directory, others)
    if good is None:
        return f"no other step there is intact (steps there: {', '.join(map(str, others))})"
    return f"pass --step={good}" + (f" (steps there: {', '.join(map(str, others))})" if len(others) > 1 else "")


def read_meta(directory: Path, step: int) -> dict:
    """The metadata a step of a Checkpointer folder records (opened read-only: a running run's save in
    progress is left alone)."""
    from meshlm.checkpoint.manager import Checkpointer, reads_that_may_fail

    ckpt = Checkpointer(directory, async_save=False, read_only=True)
    try:
        with reads_that_may_fail():
            return ckpt.meta(step)
    finally:
        ckpt.close()


def policy_from_meta(meta: dict) -> RunPolicy:
    """The RunPolicy a run recorded: meta["policy"], or for an older run the policy fields its
    meta["model"] still holds (defaults for the rest)."""
    return from_saved(meta.get("policy") or meta.get("model") or {})


def config_from_meta(model: dict) -> ModelConfig:
    """The ModelConfig saved in a checkpoint's meta["model"] (dataclasses.asdict form); the run policy's
    fields an older run saved there are left out (`policy_from_meta` reads them)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    fields = {k: v for k, v in model.items() if k in known}
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelConfig(**fields)


class TrainCheckpoint(WholeLeafSource):
    """The params of one step of a training checkpoint, restored leaf by leaf (or straight onto a mesh)."""

    def __init__(self, path: str | Path, step: int | None = None):
        import orbax.checkpoint as ocp

        from meshlm.checkpoint.manager import reads_that_may_fail

        directory, self.step, run_dir = find_checkpoint(path, step)
        self.where = str(directory / str(self.step))
        self._instead = another_step(directory, self.step)
        mismatch = checksums.first_mismatch(directory / str(self.step))
        if mismatch:
            raise UsageError(f"checkpoint {self.where} is incomplete or corrupt ({mismatch}); {self._instead}")
        try:
            meta = read_meta(directory, self.step)
        except Exception as e:  # noqa: BLE001  (unreadable metadata: a broken checkpoint)
            raise UsageError(
                f"checkpoint {self.where} has unreadable metadata ({type(e).__name__}); {self._instead}"
            ) from None
        if "model" not in meta:
            raise UsageError(f"checkpoint {self.where} records no model config; it was not written by meshlm train")
        if meta.get("lora"):
            raise UsageError(
                f"checkpoint {self.where} holds LoRA adapters, not whole weights; meshlm export "
                "--lora_format=peft writes the adapters, meshlm export --merge the merged weights"
            )
        self.cfg = config_from_meta(meta["model"])
        self.compute_dtype = policy_from_meta(meta).dtype
        self.state_dir = directory / str(self.step) / "state"
        self._ckptr = ocp.PyTreeCheckpointer()
        try:
            with reads_that_may_fail():
                tree = ocp.PyTreeCheckpointHandler().metadata(self.state_dir)
            self._stored = getattr(tree, "tree", tree)["params"]
        except Exception as e:  # noqa: BLE001
            raise UsageError(
                f"checkpoint {self.where} has unreadable state ({type(e).__name__}); {self._instead}"
            ) from None
        for leaf in leaves(self.cfg):
            try:
                shape = tuple(get_path(self._stored, leaf.path).shape)
            except (KeyError, TypeError):
                raise UsageError(f"checkpoint {self.where} has no parameter {leaf.name}") from None
            if shape != leaf.full_shape:
                raise UsageError(f"checkpoint {self.where}: {leaf.name} has shape {shape}, expected {leaf.full_shape}")
        self.carried = carried_files(run_dir / TOKENIZER_DIR) if run_dir is not None else ()

    def dtype(self, leaf: Leaf) -> np.dtype:
        return np.dtype(get_path(self._stored, leaf.path).dtype)

    def _restore(self, item: dict, restore_args: dict) -> dict:
        import orbax.checkpoint as ocp

        from meshlm.checkpoint.manager import error_line, reads_that_may_fail

        args = ocp.args.PyTreeRestore(
            item={"params": item}, restore_args={"params": restore_args}, partial_restore=True
        )
        try:
            with reads_that_may_fail():
                return self._ckptr.restore(self.state_dir, args=args)["params"]
        except Exception as e:  # noqa: BLE001  (truncated or corrupt files surface as many error types)
            raise UsageError(
                f"checkpoint {self.where} is incomplete or corrupt ({error_line(e)}); {self._instead}"
            ) from None

    def whole_leaf(self, leaf: Leaf) -> np.ndarray:
        """One whole leaf in host memory, by an Orbax partial restore of that leaf alone."""
        import orbax.checkpoint as ocp

        item: dict = {}
        args: dict = {}
        set_path(item, leaf.path, 0)
        set_path(args, leaf.path, ocp.RestoreArgs(restore_type=np.ndarray))
        return np.asarray(get_path(self._restore(item, args), leaf.path))

    def load(self, placement) -> Any:
        """Orbax reads each device's shards straight into `placement.shardings` (cast to the param dtype)."""
        import orbax.checkpoint as ocp

        abstract = placement.abstract
        return self._restore(abstract, ocp.checkpoint_utils.construct_restore_args(abstract))

    def close(self) -> None:
        super().close()
        self._ckptr.close()


__all__ = ["TrainCheckpoint", "find_checkpoint", "is_train_checkpoint", "config_from_meta", "read_meta"]
