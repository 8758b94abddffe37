"""The restore-or-init phase: the newest checkpoint of the run's folder, else `--init_from`'s weights,
else fresh random ones; each says what it did."""

from __future__ import annotations

from meshlm.checkpoint.manager import Checkpointer
from meshlm.checkpoint.weights import load_params
from meshlm.errors import UsageError
from meshlm.train import report
from meshlm.train.setup import Run
from meshlm.train.state import (
    TrainState,
    abstract_state,
    checkpointed,
    create_train_state,
    earlier_layouts,
    train_state_from_params,
)


def resume(run: Run, checkpointer: Checkpointer, latest: int, console) -> TrainState:
    """The state of checkpoint `latest` (what trains made whole again), the data position restored."""
    placement, trainable = run.job.placement, run.trainable
    target = checkpointed(abstract_state(placement, run.optimizer, trainable), trainable)
    state, data_state, saved_meta = checkpointer.restore(
        target, expect_meta=run.meta, earlier_layouts=earlier_layouts(target)
    )
    state = state._replace(params=trainable.restored(state.params, run.job.init_source, run.cfg.seed))
    try:
        run.loader.restore(data_state)
    except UsageError as e:  # the data differs from the run's: name the run and the way out
        raise UsageError(
            f"{checkpointer.directory / str(latest)}: {e}; or give a new --output_dir to start a fresh run"
        ) from None
    console.print(
        report.resumed(checkpointer.directory / str(latest), int(state.step), saved_meta, run.job.shape.flags)
    )
    change = report.schedule_change(report.schedule_of(saved_meta), run.schedule, int(state.step), run.cfg.steps)
    if change:
        console.print(change)
    return state


def restore_or_init(run: Run, checkpointer: Checkpointer, console) -> TrainState:
    placement, init_source = run.job.placement, run.job.init_source
    latest = checkpointer.latest_step()
    if latest is not None:
        return resume(run, checkpointer, latest, console)
    if init_source is not None:
        state = train_state_from_params(
            placement, run.optimizer, load_params(init_source, placement), run.trainable, run.cfg.seed
        )
        console.print(f"initialised from {init_source}")
        return state
    return create_train_state(placement, run.optimizer, run.cfg.seed, run.trainable)
