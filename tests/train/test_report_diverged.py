"""The NaN/Inf stop message names the cause the run knows of, and advises --lr or --clip_norm only for a loss
that was finite and then diverged."""

import math

from meshlm.train.diagnostics import NonFinite
from meshlm.train.report import diverged

NAN = math.nan


def test_a_loss_that_diverged_after_finite_steps_advises_lr_and_clip_norm():
    line = diverged(NonFinite(40, NAN, NAN, first_step=31), 30, "run")
    assert line == (
        "stopped at step 40: the loss became nan and the gradient norm became nan after finite steps "
        "31–39; the last good checkpoint, run/checkpoints/30, is kept: re-run to resume from it with a "
        "lower --lr or a --clip_norm (exit code 1)"
    )
    assert "after finite step 1;" in diverged(NonFinite(2, NAN, 3.0, first_step=1), None, "run")


def test_weights_that_went_nan_on_the_first_update_still_blame_the_update():
    line = diverged(NonFinite(1, NAN, NAN, weights=True, first_step=1), None, "run")
    assert line.startswith("stopped at step 1: the weights became NaN/Inf; no checkpoint") and "lower --lr" in line


def test_a_nan_at_the_runs_first_step_does_not_blame_lr():
    line = diverged(NonFinite(31, NAN, NAN, first_step=31), 30, "run")
    assert line.startswith(
        "stopped at step 31: the loss became nan and the gradient norm became nan at this run's "
        "first step, computed before any update from finite weights and in-range token ids: "
        "--lr is not the cause;"
    )
    assert "--clip_norm" not in line and "lower --lr" not in line
    assert "re-run to resume from it (exit code 1)" in line


def test_ids_outside_the_vocabulary_blame_the_data():
    bad = NonFinite(7, NAN, NAN, first_step=1, bad_ids=(5, 60000), vocab_size=4096)
    line = diverged(bad, None, "run")
    assert (
        "the batch of step 5 held token id 60000, outside the model's vocabulary of 4096: the data is the "
        "cause, not --lr; check --dataset and --tokenizer; no checkpoint was saved before it: re-run"
    ) in line
    assert "--clip_norm" not in line and "lower --lr" not in line


def test_weights_that_were_not_finite_at_the_start_blame_neither_data_nor_lr():
    restored = diverged(NonFinite(31, NAN, NAN, first_step=31, start_weights_finite=False), 30, "run")
    assert restored == (
        "stopped at step 31: the loss became nan and the gradient norm became nan; the weights this "
        "run started from already held NaN/Inf, so neither the data nor --lr is the cause: they are "
        "those of run/checkpoints/30: delete that folder to resume from the checkpoint before it, or "
        "give a new --output_dir (exit code 1)"
    )
    fresh = diverged(NonFinite(1, NAN, NAN, first_step=1, start_weights_finite=False, bad_ids=(1, 9)), None, "run")
    assert "check the weights of --init_from" in fresh and "--lr is" in fresh and "lower --lr" not in fresh
