"""Train-state checkpoints with Orbax: asynchronous, atomic, resharded on restore.

A checkpoint directory holds one folder per saved step; Orbax writes each into a temporary folder and
renames it when complete, so a process killed mid-save leaves the previous checkpoints intact and the
half-written one is ignored. Each step stores the train state (params, optimizer state, step), the data
position, and the run's metadata (model config, mesh, seed) used to detect mismatches before restoring.

Restoring takes an abstract target (shapes, dtypes and *new* shardings): every array is read straight
into its shards on the current mesh, never gathered whole on one device.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshlm.checkpoint import checksums
from meshlm.errors import UsageError

STATE, DATA, META = "state", "data", "meta"


class Checkpointer:
    """Save every `save_every` steps (and on demand), keep the newest `keep`, restore the newest complete one."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        save_every: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
    ):
        """`read_only`: a reader's view of a folder that a run may be writing into: its in-progress saves
        (temporary folders) are left alone and nothing is created."""
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        self._async = async_save
        self._saving: int | None = None  # the step whose save was started last
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            cleanup_tmp_directories=not read_only,
            # process 0, once every process has written its files, before the step's folder is renamed
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_checksums) if async_save else None,
        )
        handlers = {
            STATE: ocp.StandardCheckpointHandler(),
            DATA: ocp.JsonCheckpointHandler(),
            META: ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # ------------------------------------------------------------------------------------------- save

    def should_save(self, step: int) -> bool:
        return self.save_every is not None and self.save_every != 0 and step % self.save_every == 0

    def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
        """Start saving (returns once the arrays are copied off the devices; the write continues in the
        background). A full disk, now or in the save before, is one UsageError line."""
        self.wait()
        self._saving = step
        with self._writing():
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE: ocp.args.StandardSave(state),
                        DATA: ocp.args.JsonSave(data_state),
                        META: ocp.args.JsonSave(meta),
                    }
                ),
                force=True,
            )
            if not self._async and jax.process_index() == 0:
                checksums.record(self.directory / str(step))

    def _record_checksums(self) -> None:
        step_dir = next(
            self.directory.glob(f"{self._saving}.orbax-checkpoint-tmp*"), self.directory / str(self._saving)
        )
        checksums.record(step_dir)

    def wait(self) -> None:
        with self._writing():
            self._manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    @contextlib.contextmanager
    def _writing(self):
        """A save that fails for want of disk space is one line naming the step and the newest complete one."""
        quiet_failed_io()
        try:
            yield
        except Exception as e:
            if not disk_full(e):
                raise
            step = self._saving
            complete = [s for s in self._complete_steps() if s != step]
            last = f"the last complete checkpoint is {max(complete)}" if complete else "no checkpoint is complete yet"
            raise UsageError(
                f"no space left on device writing {self.directory / str(step)}; {last}; free some space "
                "and run again to resume from it"
            ) from None

    def _complete_steps(self) -> list[int]:
        """Steps whose folder has its final name (a save in progress has a temporary one)."""
        if not self.directory.is_dir():
            return []
        return [int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir()]

    # ---------------------------------------------------------------------------------------- restore

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def meta(self, step: int) -> dict:
        return self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

    def restore(
        self, abstract_state: Any, step: int | None = None, expect_meta: dict | None = None, earlier_layouts: tuple = ()
    ):
        """(state, data_state, meta) of `step` (default: the newest complete one), laid out as `abstract_state`.

        The step's files must match the checksums recorded when it was saved. `earlier_layouts`: pairs
        (abstract state, convert) for a state saved in a layout older than `abstract_state`'s; the first
        whose arrays the checkpoint holds is read and converted."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise UsageError(f"no complete checkpoint in {self.directory}")
        path = self.directory / str(step)
        mismatch = checksums.first_mismatch(path)
        if mismatch:
            raise self._unreadable(step, mismatch)
        try:
            with reads_that_may_fail():
                meta = self.meta(step)
        except Exception as e:  # noqa: BLE001  (any unreadable metadata means a broken checkpoint)
            raise self._unreadable(step, error_line(e)) from None
        if expect_meta is not None:
            check_compatible(path, meta, expect_meta)
        try:
            with reads_that_may_fail():
                stored = self._stored_shapes(step)
        except Exception as e:  # noqa: BLE001
            raise self._unreadable(step, error_line(e)) from None
        target, convert = abstract_state, None
        if not _holds(stored, abstract_state):
            target, convert = next(((t, c) for t, c in earlier_layouts if _holds(stored, t)), (abstract_state, None))
        check_shapes(path, stored, target)
        try:
            with reads_that_may_fail():
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            STATE: ocp.args.StandardRestore(target),
                            DATA: ocp.args.JsonRestore(),
                            META: ocp.args.JsonRestore(),
                        }
                    ),
                )
        except Exception as e:  # noqa: BLE001  (truncated or corrupt files surface as many error types)
            raise self._unreadable(step, error_line(e)) from None
        state = restored[STATE] if convert is None else convert(restored[STATE])
        return state, restored[DATA], restored[META]

    def _stored_shapes(self, step: int) -> dict[str, tuple]:
        metadata = self._manager.item_metadata(step)[STATE]
        tree = getattr(metadata, "tree", metadata)
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
        return {_keystr(path): tuple(leaf.shape) for path, leaf in leaves if hasattr(leaf, "shape")}

    def _unreadable(self, step: int, reason: str) -> UsageError:
        """The broken step, and what to do: resume from the newest earlier step whose files verify, or start over."""
        path = self.directory / str(step)
        earlier = [s for s in self.all_steps() if s < step]
        good = checksums.newest_verifying(self.directory, earlier)
        if good is not None:
            fix = f"delete that folder to resume from step {good} ({self.directory / str(good)})"
        else:
            fix = (
                "no earlier checkpoint there is intact" if earlier else "it is the only checkpoint there"
            ) + ": delete that folder to start the run over, or use another --output_dir"
        return UsageError(f"checkpoint {path} is incomplete or corrupt ({reason}); {fix}")


def _holds(stored: dict[str, tuple], abstract_state: Any) -> bool:
    """The checkpoint has every array of `abstract_state` (whatever their shapes)."""
    return all(_keystr(p) in stored for p, _ in jax.tree_util.tree_flatten_with_path(abstract_state)[0])


def error_line(error: BaseException) -> str:
    """One line saying why a read failed: the TensorStore error underneath Orbax's wrapper when there is
    one (Orbax's own message around it prints a method's repr, `<bound method ...>`), its first line."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    cause = next((c for c in chain if _STORE_ERROR.match(str(c))), error)
    text = _BOUND_METHOD.sub("", (str(cause).splitlines() or [""])[0]).strip()
    return f"{type(cause).__name__}: {text[:200]}"


_BOUND_METHOD = re.compile(r"<bound method [^>]*>\.?")


def _closed_loop_callback(unraisable) -> bool:
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


# TensorStore's errors carry an absl status code first: "OUT_OF_RANGE: Error reading ...".
_STORE_ERROR = re.compile(
    r"^(OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|FAILED_PRECONDITION|INVALID_ARGUMENT|INTERNAL|UNKNOWN|"
    r"ABORTED|CANCELLED|UNAVAILABLE|RESOURCE_EXHAUSTED|PERMISSION_DENIED): "
)


class _UnretrievedReadErrors(logging.Filter):
    """Drops asyncio's "Task/Future exception was never retrieved" for a failed TensorStore read: when
    one read of a truncated checkpoint fails, Orbax stops awaiting the others, and each of their
    errors is logged with a traceback whenever its task is garbage-collected."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "exception was never retrieved" not in message or not record.exc_info:
            return True
        error = record.exc_info[1]
        return not (isinstance(error, (ValueError, RuntimeError, OSError)) and _STORE_ERROR.match(str(error)))


class _DiskFullReports(logging.Filter):
    """Drops Orbax's log records of a save that failed for want of disk space (each with a traceback,
    from every writer thread): the save itself then fails with one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not ((error is not None and disk_full(error)) or _NO_SPACE in record.getMessage())


_NO_SPACE = "No space left on device"


def disk_full(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from or groups, is a full disk (or quota): an OSError with
    ENOSPC/EDQUOT, or TensorStore's wording of one."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if _NO_SPACE in str(e) or f"os_error_code='{errno.ENOSPC}'" in str(e):
            return True
        pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False


_quiet_closed_loops = False


def quiet_failed_io() -> None:
    """Once per process, before the first checkpoint read or write: drop the reports a failed read or
    write leaves behind it, and only those. When one array's read fails, Orbax raises and closes its
    event loop while TensorStore still finishes the other reads; each of those then reports
    `RuntimeError: Event loop is closed` through `sys.unraisablehook`, and each read error left
    unawaited is logged by asyncio when its task is collected (a traceback apiece, around the one-line
    error), possibly before the failure reaches us. A save that runs out of disk space is logged by each
    of Orbax's writer threads, and raised in them. Late callbacks into a loop that is gone, unretrieved
    TensorStore errors and full-disk reports are dropped for the rest of the process; every other report
    still reaches its hook or log."""
    global _quiet_closed_loops
    if _quiet_closed_loops:
        return
    _quiet_closed_loops = True
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _closed_loop_callback(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_UnretrievedReadErrors())
    logging.getLogger("absl").addFilter(_DiskFullReports())
    previous_thread_hook = threading.excepthook

    def thread_hook(args):
        if not disk_full(args.exc_value):
            previous_thread_hook(args)

    threading.excepthook = thread_hook


@contextlib.contextmanager
def reads_that_may_fail():
    """Around an Orbax read of a checkpoint that may be truncated (see `quiet_failed_io`)."""
    quiet_failed_io()
    yield


def _keystr(path) -> str:
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        parts.append(str(name))
    return "/".join(parts)


def check_shapes(path: Path, stored: dict[str, tuple], abstract_state: Any) -> None:
    """Name the first array whose stored shape differs from what this run expects."""
    wanted = {_keystr(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    for key, shape in wanted.items():
        if key not in stored:
            raise UsageError(f"checkpoint {path} has no array {key}; it was saved by a different model or optimizer")
        if stored[key] != shape:
            raise UsageError(
                f"checkpoint {path}: {key} has shape {stored[key]} but this model needs {shape}; "
                "use the --model flags the checkpoint was trained with"
            )


SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "tie_embeddings")


def check_compatible(path: Path, stored: dict, expected: dict) -> None:
    """The stored model config must equal this run's (mesh, batch and data order may change). One field
    apart: name it. Several: name the --model flags the checkpoint was trained with (or every stored
    value), or a new --output_dir."""
    a, b = stored.get("model", {}), expected.get("model", {})
    differ = [f for f in SHAPE_FIELDS if f in a and f in b and a[f] != b[f]]
    if not differ:
        return
    if len(differ) == 1 or differ == ["d_model", "head_dim"] or differ == ["n_heads", "head_dim"]:
        f = differ[0]
        raise UsageError(
            f"checkpoint {path} was saved with {f}={a[f]} but this run has {f}={b[f]}; "
            f"pass --model.{f}={a[f]} or use another --output_dir"
        )
    apart = ", ".join(f"{f} {a[f]} vs {b[f]}" for f in differ)
    raise UsageError(
        f"checkpoint {path} holds a different model ({apart}); to resume it pass "
        f"{_model_flags(stored)}, or pass a new --output_dir to start another run"
    )


def _model_flags(stored: dict) -> str:
    """The --model flags a checkpoint was trained with (from its saved train config), else every stored
    shape field as --model.FIELD=VALUE."""
    train = stored.get("train") or {}
    if train.get("model"):
        overrides = train.get("model_overrides") or {}
        return " ".join([f"--model={train['model']}", *(f"--model.{k}={v}" for k, v in overrides.items())])
    a = stored.get("model", {})
    return " ".join(f"--model.{f}={a[f]}" for f in SHAPE_FIELDS if f in a and f != "head_dim")


def check_run_folder(output_dir: str | Path, model: dict) -> None:
    """Before any work: the newest checkpoint in a run's `output_dir` (if any) was saved by this model
    (`model`: dataclasses.asdict of its ModelConfig). A checkpoint whose metadata cannot be read is
    left to the restore, which names it."""
    directory = Path(output_dir).expanduser().absolute() / "checkpoints"
    if not directory.is_dir() or not any(p.name.isdigit() for p in directory.iterdir()):
        return  # nothing saved yet: no need to start Orbax (its threads outlive a quick error exit)
    ckpt = Checkpointer(directory, async_save=False, read_only=True)
    try:
        step = ckpt.latest_step()
        if step is None:
            return
        try:
            meta = ckpt.meta(step)
        except Exception:  # noqa: BLE001
            return
        check_compatible(directory / str(step), meta, {"model": model})
    finally:
        ckpt.close()
