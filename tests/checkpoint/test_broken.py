"""A run folder that cannot be used is one line naming the fix, found before any work: an output_dir
that is a file, a truncated checkpoint (with no asyncio noise after the line, and a hint naming only
steps that exist), a checkpoint of another model."""

import shutil
import sys
import types

import pytest

from meshlm.errors import UsageError
from tests.support.cli import meshlm

STEPS = 2


def config(out, **kw):
    from meshlm.config import TrainConfig

    base = dict(
        model="test",
        dataset="synthetic",
        steps=STEPS,
        batch_size=8,
        seq_len=32,
        log_every=1,
        output_dir=str(out),
        peak_tflops=1.0,
        dtype="float32",
        mesh_dim="1,8,1,1",
        save_every=1,
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from meshlm.train.loop import train

    out = tmp_path_factory.mktemp("run")
    train(config(out))
    return out


def truncate(step_dir):
    """Halve every array data file of a step (what a full disk or a killed copy leaves)."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d" and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def broken_copy(run, tmp_path, keep_steps):
    shutil.copytree(run, tmp_path / "run")
    for step in range(1, STEPS + 1):
        if step not in keep_steps:
            shutil.rmtree(tmp_path / "run" / "checkpoints" / str(step))
    truncate(tmp_path / "run" / "checkpoints" / str(max(keep_steps)))
    return tmp_path / "run"


def one_line(result):
    err = result.stderr.strip().splitlines()
    err = [line for line in err if line.startswith("error:") or "Traceback" in line or "Event loop" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith("error:"), result.stderr[-3000:]
    return err[0]


@pytest.mark.parametrize("how", ["file", "under a file"])
@pytest.mark.parametrize("command", ["train", "export", "convert"])
def test_output_folder_that_is_a_file(tmp_path, capsys, how, command, run):
    from meshlm.cli import main

    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    out = afile if how == "file" else afile / "run"
    argv = {
        "train": ["train", "--model=test", "--dataset=synthetic", f"--output_dir={out}"],
        "export": ["export", f"--checkpoint={run}", f"--out={out}"],
        "convert": ["convert", f"--to_hf={out}", f"--checkpoint={run}"],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err, err
    assert ("is a file" if how == "file" else "which is a file") in err, err
    assert afile.read_text() == "x"


def test_truncated_checkpoint_names_the_step_before(run, tmp_path):
    out = broken_copy(run, tmp_path, keep_steps=(1, 2))
    line = one_line(
        meshlm(
            "train",
            "--devices=8",
            "--model=test",
            "--dataset=synthetic",
            "--steps=3",
            "--batch_size=8",
            "--seq_len=32",
            "--mesh_dim=1,8,1,1",
            f"--output_dir={out}",
            timeout=300,
        )
    )
    assert f"{out / 'checkpoints' / '2'} is incomplete" in line and "resume from step 1" in line, line


def test_truncated_only_checkpoint_names_no_other_step(run, tmp_path):
    out = broken_copy(run, tmp_path, keep_steps=(1,))
    with pytest.raises(UsageError) as err:
        from meshlm.train.loop import train

        train(config(out, steps=3))
    assert "only checkpoint" in str(err.value) and "step 0" not in str(err.value), err.value
    line = one_line(
        meshlm("export", f"--checkpoint={out}", f"--out={tmp_path / 'w'}", env={"JAX_PLATFORMS": "cpu"}, timeout=300)
    )
    assert "no other --step" in line, line
    assert not (tmp_path / "w").exists()


def test_truncated_checkpoint_export_offers_steps_that_exist(run, tmp_path):
    out = broken_copy(run, tmp_path, keep_steps=(1, 2))
    line = one_line(
        meshlm("export", f"--checkpoint={out}", f"--out={tmp_path / 'w'}", env={"JAX_PLATFORMS": "cpu"}, timeout=300)
    )
    assert "--step=1" in line and "--step=3" not in line, line


def test_missing_step_lists_the_steps_there(run, capsys):
    from meshlm.cli import main

    assert main(["export", f"--checkpoint={run}", "--step=9", "--out=/nonexistent/never"]) == 2
    err = capsys.readouterr().err
    assert "no step 9" in err and "1, 2" in err, err


def test_checkpoint_reads_silence_only_closed_event_loop_reports(monkeypatch):
    """Once checkpoints are read, TensorStore's late callbacks into Orbax's closed loop are dropped; any
    other unraisable exception still reaches the hook that was there before."""
    from meshlm.checkpoint import manager

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    monkeypatch.setattr(manager, "_quiet_closed_loops", False)
    with pytest.raises(ValueError):
        with manager.reads_that_may_fail():
            raise ValueError("truncated")
    report = lambda exc: sys.unraisablehook(types.SimpleNamespace(exc_value=exc, exc_type=type(exc)))  # noqa: E731
    report(RuntimeError("Event loop is closed"))
    other = RuntimeError("something else")
    report(other)
    assert seen == [other]


def test_checkpoint_reads_silence_only_unretrieved_store_errors(monkeypatch):
    """A failed read leaves TensorStore errors in tasks nobody awaits; asyncio's report of each, when the
    task is collected, is dropped once checkpoints are read. Any other unretrieved exception is logged."""
    import asyncio
    import gc
    import logging

    from meshlm.checkpoint import manager

    monkeypatch.setattr(manager, "_quiet_closed_loops", False)
    asyncio_logger = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_logger, "filters", list(asyncio_logger.filters))
    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.exc_info[1] if record.exc_info else record.getMessage())

    handler = Keep()
    asyncio_logger.addHandler(handler)
    try:
        with manager.reads_that_may_fail():
            pass

        async def fail(error):
            raise error

        def abandon(error):
            loop = asyncio.new_event_loop()
            task = loop.create_task(fail(error))
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()
            del task
            gc.collect()

        abandon(ValueError('OUT_OF_RANGE: Error reading "opt_state.1.0.count/.zarray"'))
        other = ValueError("a bug")
        abandon(other)
    finally:
        asyncio_logger.removeHandler(handler)
    assert logged == [other], logged


def test_other_model_is_found_before_the_tokenizer(run, monkeypatch):
    """A whole different model: named by the flags it was trained with, before any data work."""
    from meshlm import data
    from meshlm.train.loop import train

    def no_tokenizer(*a, **k):
        raise AssertionError("the tokenizer was built before the checkpoint was checked")

    monkeypatch.setattr(data, "load_tokenizer", no_tokenizer)
    with pytest.raises(UsageError) as err:
        train(config(run, model="tiny", steps=STEPS + 1, dataset="stdlib"))
    msg = str(err.value)
    assert "--model=test" in msg and "--output_dir" in msg and "d_model 64 vs 256" in msg, msg
    with pytest.raises(UsageError) as err:
        train(config(run, model_overrides={"n_layers": "3"}, steps=STEPS + 1, dataset="stdlib"))
    assert "--model.n_layers=2" in str(err.value), err.value
