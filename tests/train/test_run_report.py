"""What a run says about itself: a finished run re-run, a resume (mesh change, stretched schedule), the
closing summary of the steps this process ran, the whole run's curve, and logs that do not wrap."""

import io
import json
import logging
import re
import shutil

import jax
import pytest

from meshlm.config import TrainConfig
from meshlm.models.configs import count_params
from meshlm.train.console import plural, run_console
from meshlm.train.loop import train
from meshlm.train.report import meshlm_command, schedule_change, summary_lines

BASE = dict(
    model="test",
    dataset="synthetic",
    batch_size=8,
    seq_len=32,
    log_every=1,
    lr=1e-2,
    dtype="float32",
    peak_tflops=1.0,
    mesh_dim="1,8,1,1",
    min_lr_ratio=0.1,
    warmup_steps=0,
)


def config(out, **kw):
    return TrainConfig(**{**BASE, "output_dir": str(out), **kw})


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished run of 2 steps (copied by each test that continues it)."""
    out = tmp_path_factory.mktemp("two_steps")
    train(config(out, steps=2), console=run_console(file=io.StringIO()))
    return out


def test_rerunning_a_finished_run_says_so_without_compiling(two_steps, capsys):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.DEBUG)
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            summary = train(config(two_steps, steps=2))
    finally:
        logging.getLogger("jax").removeHandler(handler)
    out = capsys.readouterr().out
    assert summary["already_done"] and summary["steps_run"] == 0 and summary["checkpoint_step"] == 2
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert f"{two_steps} is already at step 2 (--steps=2): nothing to train" in lines[0]
    assert "raise --steps" in lines[0] and "new --output_dir" in lines[0]
    assert "resumed" not in out and "step 2/2" not in out
    assert not [m for m in records if m.startswith("Compiling")], records
    assert [r["step"] for r in rows(two_steps)] == [1, 2]  # nothing written twice


def test_resume_reports_mesh_schedule_and_only_the_steps_it_ran(two_steps, tmp_path, capsys):
    out = tmp_path / ("a_folder_name_long_enough_to_pass_eighty_columns_" * 2)  # a log line rich used to cut
    shutil.copytree(two_steps, out)
    summary = train(config(out, steps=4, mesh_dim="2,1,4,1"))
    text = capsys.readouterr().out
    lines = text.splitlines()

    def line_with(phrase):
        found = [line for line in lines if phrase in line]
        assert found, f"{phrase!r} on no single line of:\n{text}"
        return found[0]

    resumed = line_with(f"resumed from {out / 'checkpoints' / '2'} at step 2")
    assert "saved on --mesh_dim=1,8,1,1, restored onto --mesh_dim=2,1,4,1" in resumed
    schedule = line_with("the learning-rate schedule now spans 4 steps, not the 2")
    assert "pass --schedule_steps=2 to keep the original schedule" in schedule
    done = line_with("done: ran steps 3–4 (2 steps, resumed from step 2)")
    assert re.search(r"loss \d\.\d{3} \(step 3\) → \d\.\d{3} \(step 4\)", done), done
    assert "over 4 steps" not in text
    line_with(f"checkpoint {out / 'checkpoints' / '4'}")
    line_with(f"next: {meshlm_command()} generate --checkpoint={out}")
    # The policy --remat=auto chose (on CPU: every activation kept, the test model's scratch being small).
    assert "; compute float32, params float32, remat none (auto)" in line_with("model: test")
    assert summary["first_step"] == 3 and summary["steps_run"] == 2
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]


def test_schedule_steps_keeps_the_first_runs_schedule(two_steps, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    train(config(out, steps=4, schedule_steps=2))
    assert "schedule now spans" not in capsys.readouterr().out
    lr = {r["step"]: r["lr"] for r in rows(out)}
    assert lr[3] == pytest.approx(1e-3) and lr[4] == pytest.approx(1e-3)  # the 2-step cosine ended at lr × 0.1


def test_schedule_change_names_the_flags_that_keep_it():
    before = {"lr": 1e-3, "warmup_steps": 12, "total_steps": 120, "min_lr_ratio": 0.1}
    assert schedule_change(before, dict(before), 120, 200) is None
    line = schedule_change(before, {**before, "warmup_steps": 20, "total_steps": 200}, 120, 200)
    assert "--schedule_steps=120 --warmup_steps=12" in line and "stretches to step 200" in line
    old_meta = {"train": {"steps": 120, "warmup_steps": None, "lr": 1e-3, "min_lr_ratio": 0.1}}  # before "schedule"
    from meshlm.train.report import schedule_of

    assert schedule_of(old_meta) == before


def test_summary_of_a_stopped_run():
    lines = summary_lines(
        first_step=31,
        last_step=37,
        total_steps=120,
        history=[{"step": 35, "loss": 6.5}],
        evals=[],
        stopped="SIGINT",
        output_dir="outputs/run",
        checkpoint=None,
    )
    assert (
        lines[0]
        == "stopped by SIGINT after step 37: ran steps 31–37 (7 steps, resumed from step 30); loss 6.500 (step 35)"
    )
    assert lines[-1] == "next: the same command resumes from step 37"
    one = summary_lines(
        first_step=1,
        last_step=1,
        total_steps=1,
        history=[],
        evals=[],
        stopped=None,
        output_dir="out dir",
        checkpoint=None,
    )
    meshlm = meshlm_command()  # as meshlm runs from this shell (tests/train/test_report_next.py)
    assert (
        one[0] == "done: ran step 1 (1 step)"
        and one[-1] == f"next: {meshlm} generate --checkpoint='out dir' --prompt='def '"
    )
    chat = summary_lines(
        first_step=1,
        last_step=1,
        total_steps=1,
        history=[],
        evals=[],
        stopped=None,
        output_dir="run",
        checkpoint=None,
        chat=True,
    )
    assert chat[-1] == f"next: {meshlm} serve --checkpoint=run   # then open http://127.0.0.1:8000/"


def test_the_plot_reads_the_whole_run(tmp_path, monkeypatch):
    """A resumed run's loss.png has every step of metrics.jsonl, not only the steps of this process."""
    from meshlm.train import plot
    from meshlm.train.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 7.0 - s / 10}) + "\n" for s in (1, 2, 3))
        + json.dumps({"step": 3, "eval_loss": 6.9})
        + "\n"
        + '{"step": 4, "lo'
    )
    drawn = {}
    monkeypatch.setattr(plot, "plot_run", lambda png, rows, title="": drawn.update(rows=rows))
    logger = MetricsLogger(
        tmp_path, flops_per_token=1.0, peak_flops_per_device=1.0, n_devices=1, total_steps=6, log_every=1
    )
    for step in (4, 5, 6):
        logger.log(step, loss=6.0, tokens=1, seconds=1.0)
    logger.close()
    train_curve, eval_curve = plot.curves(drawn["rows"])
    assert list(train_curve) == [1, 2, 3, 4, 5, 6] and eval_curve == {3: 6.9}
    assert plot.smooth([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no ramp from 0


def test_logs_in_a_file_keep_lines_whole():
    buf = io.StringIO()
    console = run_console(file=buf)
    assert not console.is_terminal
    console.print("word " * 60)
    assert len(buf.getvalue().strip().splitlines()) == 1


def test_counts_read_as_words():
    assert plural(1, "device") == "1 device" and plural(8, "cpu device") == "8 cpu devices"
    assert plural(1, "process") == "1 process" and plural(2, "process") == "2 processes"
    assert plural(2, "batch") == "2 batches"
    assert [count_params(n) for n in (5.51e6, 1.24e9, 820e3, 640)] == ["5.51M", "1.24B", "820K", "640"]
    from meshlm.train.metrics import resolve_peak

    source = resolve_peak(None, "float32")[1]
    assert "device(s)" not in source and source.endswith(f"/ {plural(jax.local_device_count(), 'device')}")


def test_help_shows_the_seed_default_and_what_output_dir_holds():
    from meshlm.cli.train import parser

    text = " ".join(parser().format_help().split())
    seed = text[text.rindex("--seed INT") :][:200]
    assert "default: 0" in seed, seed
    output_dir = text[text.rindex("--output_dir STR") :][:300]
    assert "checkpoints" in output_dir, output_dir
    for flag in ("--schedule_steps", "--eval_dataset", "--eval_split", "--eval_every", "--eval_batches"):
        assert flag in text


def test_resuming_on_other_data_names_the_checkpoint_and_a_fresh_output_dir(two_steps, tmp_path):
    """The run's data differs from the checkpoint's: the line names the checkpoint, what differs, and the
    way out (the same data, or a new --output_dir)."""
    from meshlm.errors import UsageError

    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a small corpus, long enough to fill some rows" for i in range(400)))
    with pytest.raises(UsageError) as err:
        train(config(out, steps=3, dataset=str(corpus)), console=run_console(file=io.StringIO()))
    msg = str(err.value)
    assert msg.startswith(f"{out / 'checkpoints' / '2'}: the checkpoint was trained on 0 rows of data"), msg
    assert msg.endswith(
        "resume with the same dataset, tokenizer and seq_len; or give a new --output_dir to start a fresh run"
    ), msg


def test_a_warmup_past_the_last_step_is_noted(tmp_path):
    out = tmp_path / "run"
    log = io.StringIO()
    train(config(out, steps=2, warmup_steps=50), console=run_console(file=log))
    assert "note: --warmup_steps=50 is not below --steps=2: the learning rate never reaches --lr=0.01" in log.getvalue()
