"""Fine-tuning runs: chat data end to end, a NaN/Inf stop that keeps the last good checkpoint, the profiler
trace, the trackers (none, wandb offline through a stand-in module), and bad values as one line."""

import importlib.machinery
import io
import json
import sys
import types
from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.config import TrainConfig
from meshlm.train.console import run_console
from meshlm.train.loop import train

SHIPPED = Path(__file__).parents[2] / "examples" / "chat_small.jsonl"
BASE = dict(
    model="test",
    dataset="synthetic",
    batch_size=8,
    seq_len=32,
    lr=1e-2,
    dtype="float32",
    peak_tflops=1.0,
    mesh_dim="1,8,1,1",
    warmup_steps=0,
)
FLAGS = [
    "--model=test",
    "--dataset=synthetic",
    "--batch_size=8",
    "--seq_len=32",
    "--dtype=float32",
    "--peak_tflops=1",
    "--mesh_dim=1,8,1,1",
    "--warmup_steps=0",
]


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


def run(out, **kw):
    log = io.StringIO()
    summary = train(TrainConfig(**{**BASE, "output_dir": str(out), **kw}), console=run_console(file=log))
    return summary, log.getvalue()


def test_chat_fine_tuning_logs_its_data_and_keeps_the_template_for_serving(tmp_path):
    out = tmp_path / "run"
    summary, log = run(
        out,
        dataset=str(SHIPPED),
        seq_len=128,
        steps=2,
        log_every=1,
        chat_template="chatml",
        long_conversations="drop",
        tracker="none",
    )
    assert summary["final_loss"] is not None and summary["diverged"] is None
    assert "chat data: 50 conversations in" in log and "template chatml; loss on assistant tokens" in log
    assert "longer than --seq_len=128 dropped" in log or "longer than" not in log
    rows = int(log.split("chat data: 50 conversations in ")[1].split(" rows")[0])
    assert f"an epoch) is {rows // 8} step" in log and f"--steps=2 makes {2 / (rows // 8):.3g} passes" in log
    from meshlm.checkpoint.folders import carried_files  # the files a run's checkpoint carries to meshlm serve
    from meshlm.serve.loading import read_chat_template

    files = {f.name: f for f in carried_files(out / "tokenizer")}
    assert "<|im_start|>" in read_chat_template(files)  # meshlm serve renders alike
    assert not (out / "tb").exists()  # --tracker=none: metrics.jsonl and loss.png only
    assert (out / "metrics.jsonl").is_file() and (out / "loss.png").is_file()


def test_a_nan_stops_within_the_log_interval_and_the_last_good_checkpoint_restores(tmp_path, monkeypatch, capsys):
    import jax
    import jax.numpy as jnp

    import meshlm.train.step as step_module

    real = step_module.make_train_step

    def poisoned(*args, **kw):  # from step 5 on the loss is NaN and the weights too
        step_fn, calls = real(*args, **kw), []

        def step(state, batch):  # (the state's buffers are donated: count the calls instead of reading it)
            new, metrics = step_fn(state, batch)
            calls.append(1)
            if len(calls) >= 5:
                metrics = {**metrics, "loss": metrics["loss"] * jnp.nan}
                new = new._replace(params=jax.tree.map(lambda p: p * jnp.nan, new.params))
            return new, metrics

        return step

    monkeypatch.setattr(step_module, "make_train_step", poisoned)
    out = tmp_path / "run"
    code = main(["train", *FLAGS, "--steps=12", "--log_every=3", "--save_every=2", f"--output_dir={out}"])
    printed = capsys.readouterr().out
    assert code == 1
    stops = [line for line in printed.splitlines() if "stopped at step" in line]
    assert len(stops) == 1 and stops[0].startswith("stopped at step 5: the loss became nan"), printed
    assert f"{out / 'checkpoints' / '4'}, is kept" in stops[0]
    steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 4]  # step 6 (log and save) found the NaN first: nothing saved after it
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3, 6]  # stopped at the first log step after the NaN

    monkeypatch.setattr(step_module, "make_train_step", real)
    assert main(["train", *FLAGS, "--steps=6", "--log_every=3", f"--output_dir={out}"]) == 0
    assert f"resumed from {out / 'checkpoints' / '4'} at step 4" in capsys.readouterr().out


def test_profile_steps_write_a_trace_into_the_run_folder(tmp_path):
    out = tmp_path / "run"
    summary, log = run(out, steps=3, log_every=3, profile_steps="2:3")
    traces = list((out / "profile").rglob("*.xplane.pb"))
    assert traces and f"profiling steps 2..3 into {out / 'profile'}" in log
    assert f"profile written to {traces[0]}" in log


def test_wandb_offline_gets_the_metrics(tmp_path, monkeypatch):
    logged, runs = [], []

    class Run:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            runs.append("finished")

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.util = types.SimpleNamespace(generate_id=lambda: "abc123")
    fake.init = lambda **kw: runs.append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    run(out, steps=2, log_every=1, tracker="wandb")
    assert runs[0]["dir"] == str(out) and runs[0]["id"] == "abc123" and runs[0]["resume"] == "allow"
    assert runs[-1] == "finished" and (out / "wandb_run_id").read_text().strip() == "abc123"
    assert [s for s, _ in logged] == [1, 2] and "loss" in logged[0][1] and not (out / "tb").exists()


@pytest.mark.parametrize(
    "flag,message",
    [
        ("--tracker=mlflow", "--tracker=mlflow: choose tensorboard, wandb or none"),
        ("--profile_steps=3:1", "--profile_steps=3:1: write FIRST:LAST"),
        ("--profile_steps=a:b", "--profile_steps=a:b: write FIRST:LAST"),
        ("--profile_steps=50:60", "--profile_steps=50:60 starts after the last step (12)"),
        ("--loss_on=everything", "--loss_on=everything: choose assistant or all"),
        ("--long_conversations=split", "--long_conversations=split: choose truncate or drop"),
    ],
)
def test_bad_values_are_one_line_and_exit_code_2(flag, message, capsys, tmp_path):
    assert main(["train", *FLAGS, "--steps=12", f"--output_dir={tmp_path / 'run'}", flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_wandb_missing_names_the_install(capsys, tmp_path, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec  # as if wandb were not installed, whatever this machine has
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a))
    assert main(["train", *FLAGS, "--tracker=wandb", f"--output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tracker=wandb needs the wandb package: pip install wandb" in err[0]
