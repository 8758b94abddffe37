"""`meshlm eval` from the command line: bad input is one line and exit code 2 before anything loads,
every flag is documented, and a 100-question task on the `tiny` preset runs well inside two minutes."""

from __future__ import annotations

import sys
import time

import pytest

from meshlm.cli import main
from tests.eval.conftest import save_checkpoint
from tests.eval.local_tasks import multiple_choice
from tests.support.cli import meshlm


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "loading" not in captured.err + captured.out  # found before the model loads
    return err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch_size=0"], "--batch_size=0 must be a positive integer"),
        (["--max_gen_toks=-1"], "--max_gen_toks=-1 must be a positive integer"),
        (["--num_fewshot=-1"], "--num_fewshot=-1 must be 0 or more"),
        (["--limit=1.5"], "--limit=1.5: give a number of examples"),
        (["--limit=0"], "--limit=0: give a number of examples"),
        (["--include_path=/no/such/folder"], "is not a folder"),
        (["--log_samples"], "give --output_path=FOLDER"),
        (["--taks=x"], "did you mean --tasks?"),
        (["--prefill_buckets=a,b"], "--prefill_buckets=a,b: give comma-separated lengths"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(capsys, checkpoint, tasks, flags, message):
    base = [f"--checkpoint={checkpoint}", f"--include_path={tasks[0]}", f"--tasks={tasks[1]['mc']}"]
    names = {f.split("=")[0] for f in flags}
    argv = ["eval", *[f for f in base if f.split("=")[0] not in names], *flags]
    assert message in _one_line_error(capsys, argv)


def test_missing_checkpoint_and_tasks(capsys, tasks):
    assert "--checkpoint=/no/such/run does not exist" in _one_line_error(
        capsys, ["eval", "--checkpoint=/no/such/run", f"--tasks={tasks[1]['mc']}"]
    )
    assert "--tasks" in _one_line_error(capsys, ["eval", "--checkpoint=/no/such/run"])


def test_unknown_task_lists_close_names(capsys, checkpoint, tasks):
    """A misspelt local task and a misspelt built-in one, in one call: indexing lm-eval's built-in tasks
    takes seconds, and both names need it."""
    pytest.importorskip("lm_eval")
    folder, names = tasks
    err = _one_line_error(
        capsys, ["eval", f"--checkpoint={checkpoint}", f"--include_path={folder}", "--tasks=meshlm_mc2O,hellaswagg"]
    )
    assert "no task named meshlm_mc2O, hellaswagg;" in err
    close = err.split("close names:")[1]
    assert names["mc"] in close and "hellaswag" in close.replace("hellaswagg", "")


def test_without_lm_eval_says_how_to_install(capsys, monkeypatch, checkpoint, tasks):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    err = _one_line_error(capsys, ["eval", f"--checkpoint={checkpoint}", f"--tasks={tasks[1]['mc']}"])
    assert "pip install -e '.[eval]'" in err


def test_every_flag_is_documented(capsys):
    from meshlm.cli.eval import _parser

    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for action in _parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert flag in out and action.help, flag
    for flag in (
        "--checkpoint",
        "--mesh_dim",
        "--tasks",
        "--num_fewshot",
        "--limit",
        "--batch_size",
        "--output_path",
        "--include_path",
        "--max_seq_len",
        "--devices",
    ):
        assert flag in out, flag


def test_tiny_preset_on_a_100_question_task_within_two_minutes(tmp_path):
    pytest.importorskip("lm_eval")
    checkpoint = save_checkpoint(tmp_path / "model", "tiny")
    name = multiple_choice(tmp_path / "tasks", 100, seed=3)
    t0 = time.perf_counter()
    result = meshlm(
        "eval",
        f"--checkpoint={checkpoint}",
        "--devices=2",
        f"--include_path={tmp_path / 'tasks'}",
        f"--tasks={name}",
        "--batch_size=32",
        f"--output_path={tmp_path / 'out.json'}",
        timeout=300,
    )
    seconds = time.perf_counter() - t0
    assert result.returncode == 0, result.stderr[-3000:]
    assert name in result.stdout and "acc_norm" in result.stdout
    [written] = list(tmp_path.glob("out_*.json"))
    assert '"acc,none"' in written.read_text()
    print(f"meshlm eval, tiny preset, 100 questions × 4 choices: {seconds:.1f} s")
    assert seconds < 120, f"{seconds:.0f} s"


def test_a_task_whose_data_cannot_be_downloaded_is_one_usage_error(monkeypatch):
    """Built-in tasks download their data from the Hub; without a network that is one line naming what
    to do, not lm-eval's traceback. Any other OSError (a local fault) goes on as it is."""
    lm_eval = pytest.importorskip("lm_eval")
    from meshlm.errors import UsageError
    from meshlm.eval import harness

    def offline(**_):
        raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (ConnectionError)")

    def local_fault(**_):
        raise PermissionError("permission denied: results.json")

    monkeypatch.setattr(lm_eval, "simple_evaluate", offline)
    with pytest.raises(
        UsageError,
        match=r"could not download a task's data \(Couldn't reach 'Rowan/hellaswag'.*"
        r"HF_DATASETS_OFFLINE=1.*--include_path",
    ):
        harness.run_tasks(object(), ["hellaswag"], None)
    monkeypatch.setattr(lm_eval, "simple_evaluate", local_fault)
    with pytest.raises(PermissionError):
        harness.run_tasks(object(), ["hellaswag"], None)
