"""A pipeline stage must hold whole repeats of the model's local/global layer pattern: otherwise its
layers would not know which of them are local. `meshlm.job.check_mesh` says so in one line."""

import pytest

from meshlm.cli import main

LG = ["--model=test", "--model.n_layers=4", "--model.sliding_window=8", "--model.layer_pattern=LG"]
JOB = ["--devices=8", "--batch_size=16", "--seq_len=32", "--hardware=h100", "--top=1"]


def test_a_stage_that_splits_the_pattern_is_one_line(capsys):
    assert main(["plan", *LG, *JOB, "--pp=4", "--mesh_dim=2,1,1,1"]) == 2
    err = capsys.readouterr().err
    assert "a stage of 1 layers is not whole repeats of --model.layer_pattern=LG (2 layers)" in err
    assert "n_layers=4 / (pp × virtual_stages) is a multiple of 2" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags", [["--pp=2", "--mesh_dim=4,1,1,1"], ["--model.layer_pattern=", "--pp=4", "--mesh_dim=2,1,1,1"]]
)
def test_stages_of_whole_repeats_or_no_pattern_pass(capsys, flags):
    assert main(["plan", *LG, *JOB, *flags]) == 0, capsys.readouterr().err
