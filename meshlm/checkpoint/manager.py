"""Train-state checkpoints with Orbax: asynchronous, atomic, resharded on restore.

A checkpoint directory holds one folder per saved step; Orbax writes each into a temporary folder and
renames it when complete, so a process killed mid-save leaves the previous checkpoints intact and the
half-written one is ignored. Each step stores the train state (params, optimizer state, step), the data
position, and the run's metadata (model config, mesh, seed) used to detect mismatches before restoring.

Restoring takes an abstract target (shapes, dtypes and *new* shardings): every array is read straight
into its shards on the current mesh, never gathered whole on one device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshlm.errors import UsageError

STATE, DATA, META = "state", "data", "meta"


class Checkpointer:
    """Save every `save_every` steps (and on demand), keep the newest `keep`, restore the newest complete one."""

    def __init__(self, directory: str | Path, *, keep: int = 3, save_every: int | None = None, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True
        )
        handlers = {STATE: ocp.StandardCheckpointHandler(), DATA: ocp.JsonCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # ------------------------------------------------------------------------------------------- save

    def should_save(self, step: int) -> bool:
        return bool(self.save_every) and step % self.save_every == 0

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        """Start saving (returns once the arrays are copied off the devices; the write continues in the background)."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{STATE: ocp.args.StandardSave(state), DATA: ocp.args.JsonSave(data_state), META: ocp.args.JsonSave(meta)}
            ),
            force=True,
        )

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    # ---------------------------------------------------------------------------------------- restore

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def meta(self, step: int) -> dict:
        return self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def restore(self, abstract_state: Any, step: int | None = None, expect_meta: dict | None = None):
        """(state, data_state, meta) of `step` (default: the newest complete one), laid out as `abstract_state`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UsageError(f"no complete checkpoint in {self.directory}")
        path = self.directory / str(step)
        try:
            meta = self.meta(step)
        except Exception as e:  # noqa: BLE001  (any unreadable metadata means a broken checkpoint)
            raise _unreadable(path, e) from None
        if expect_meta is not None:
            check_compatible(path, meta, expect_meta)
        try:
            stored = self._stored_shapes(step)
        except Exception as e:  # noqa: BLE001
            raise _unreadable(path, e) from None
        check_shapes(path, stored, abstract_state)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{STATE: ocp.args.StandardRestore(abstract_state), DATA: ocp.args.JsonRestore(), META: ocp.args.JsonRestore()}
                ),
            )
        except Exception as e:  # noqa: BLE001  (truncated or corrupt files surface as many error types)
            raise _unreadable(path, e) from None
        return restored[STATE], restored[DATA], restored[META]

    def _stored_shapes(self, step: int) -> dict[str, tuple]:
        metadata = self._manager.item_metadata(step)[STATE]
        tree = getattr(metadata, "tree", metadata)
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
        return {_keystr(path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}


def _unreadable(path: Path, error: Exception) -> UsageError:
    first = (str(error).splitlines() or [""])[0][:200]
    return UsageError(
        f"checkpoint {path} is incomplete or corrupt ({type(error).__name__}: {first}); "
        "delete that folder to resume from the one before it"
    )


def _keystr(path) -> str:
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        parts.append(str(name))
    return "/".join(parts)


def check_shapes(path: Path, stored: dict[str, tuple], abstract_state: Any) -> None:
    """Name the first array whose stored shape differs from what this run expects."""
    wanted = {
        _keystr(p): tuple(leaf.shape)
        for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    }
    for key, shape in wanted.items():
        if key not in stored:
            raise UsageError(f"checkpoint {path} has no array {key}; it was saved by a different model or optimizer")
        if stored[key] != shape:
            raise UsageError(
                f"checkpoint {path}: {key} has shape {stored[key]} but this model needs {shape}; "
                "use the --model flags the checkpoint was trained with"
            )


def check_compatible(path: Path, stored: dict, expected: dict) -> None:
    """The stored model config must equal this run's (mesh, batch and data order may change)."""
    a, b = stored.get("model", {}), expected.get("model", {})
    shape_fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "tie_embeddings")
    for f in shape_fields:
        if f in a and f in b and a[f] != b[f]:
            raise UsageError(
                f"checkpoint {path} was saved with {f}={a[f]} but this run has {f}={b[f]}; "
                f"pass --model.{f}={a[f]} or use another --output_dir"
            )

