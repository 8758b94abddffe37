"""Evaluation during training: the eval loss is the model's loss on the held-out rows (checked against an
independent forward pass), it is written everywhere the training loss is, and evaluating never recompiles."""

import json
import logging
import math
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlm.checkpoint.weights import load_params
from meshlm.config import TrainConfig
from meshlm.data import held_out_rows, load_tokenizer, pack_rows, tokenize_corpus
from meshlm.errors import UsageError
from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.train.loop import train

SPLIT, EVAL_BATCHES, B, T = 0.2, 2, 8, 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evalcorpus")
    for module in (json, textwrap):
        (folder / f"{module.__name__}.txt").write_text(Path(module.__file__).read_text())
    return str(folder)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """4 steps evaluating after steps 2 and 4, every compile logged."""
    out = tmp_path_factory.mktemp("evalrun")
    mp = pytest.MonkeyPatch()
    mp.setenv("MESHLM_CACHE", str(out / "cache"))
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.DEBUG)
    jax_logger = logging.getLogger("jax")
    jax_logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            summary = train(
                TrainConfig(
                    model="test",
                    dataset=corpus,
                    steps=4,
                    batch_size=B,
                    seq_len=T,
                    log_every=1,
                    lr=1e-2,
                    dtype="float32",
                    mesh_dim="2,2,2,1",
                    output_dir=str(out / "run"),
                    peak_tflops=1.0,
                    eval_split=SPLIT,
                    eval_every=2,
                    eval_batches=EVAL_BATCHES,
                )
            )
    finally:
        jax_logger.removeHandler(handler)
        mp.undo()
    return out, summary, records


def test_eval_loss_equals_an_independent_forward_pass(run, corpus):
    out, summary, _ = run
    assert [e["step"] for e in summary["evals"]] == [2, 4]
    got = summary["evals"][-1]  # after step 4, with the parameters of checkpoint 4
    cfg = resolve_model("test")
    mesh = build_mesh(parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1])
    placement = place(cfg, mesh, policy=RunPolicy(dtype="float32"))
    params = load_params(str(out / "run"), placement)
    tok = load_tokenizer(None, corpus, cfg.vocab_size, cache_dir=out / "cache")
    tokens = tokenize_corpus(corpus, tok, cache_dir=out / "cache")
    rows = held_out_rows((len(tokens) - 1) // T, SPLIT)[: EVAL_BATCHES * B]
    batch = pack_rows(np.stack([tokens[r * T : r * T + T + 1] for r in rows]), tok.eos_id)
    logits = np.asarray(
        jax.jit(placement.apply)(params, batch["inputs"], batch["positions"], batch["segment_ids"]), np.float64
    )
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None].astype(np.int64), -1)[..., 0]
    want = (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    assert got["eval_tokens"] == int(batch["loss_mask"].sum())
    np.testing.assert_allclose(got["eval_loss"], want, rtol=2e-5)
    assert got["eval_perplexity"] == pytest.approx(math.exp(want), rel=1e-4)


def test_no_recompile_across_evaluations(run):
    _, _, records = run
    compiles = [m for m in records if m.startswith("Compiling ")]
    assert sum(m.startswith("Compiling jit(eval_step) ") for m in compiles) == 1, compiles
    assert sum(m.startswith("Compiling jit(step) ") for m in compiles) == 1, compiles


def test_eval_is_logged_to_jsonl_tensorboard_console_and_plot(run, monkeypatch):
    out, summary, _ = run
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and all("loss" not in r for r in evals)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert evals[-1]["eval_loss"] == summary["evals"][-1]["eval_loss"]
    assert evals[-1]["eval_perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    from tests.train.test_metrics import _tb_scalars

    scalars = _tb_scalars(out / "run" / "tb")
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4] and "eval/perplexity" in scalars
    from meshlm.train.plot import curves, read_metrics

    train_curve, eval_curve = curves(read_metrics(out / "run" / "metrics.jsonl"))
    assert list(train_curve) == [1, 2, 3, 4] and list(eval_curve) == [2, 4]
    assert (out / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(eval_split=0.0), "--eval_split=0.0 must be a fraction strictly between 0 and 1"),
        (dict(eval_split=1.0), "--eval_split=1.0 must be a fraction strictly between 0 and 1"),
        (dict(eval_split=0.1, eval_dataset="stdlib"), "pass one of them"),
        (dict(eval_split=0.1, eval_every=0), "--eval_every=0 must be a positive integer"),
        (dict(eval_split=0.1, eval_batches=-1), "--eval_batches=-1 must be a positive integer"),
        (dict(eval_every=5), "--eval_every needs something to evaluate"),
        (dict(eval_batches=5), "--eval_batches needs something to evaluate"),
        (dict(eval_dataset=" "), "--eval_dataset is empty"),
    ],
)
def test_eval_flags_are_checked(flags, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        TrainConfig(**flags).validate()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eval_split=1.5"], "--eval_split=1.5 must be a fraction strictly between 0 and 1"),
        (["--eval_split=0.1", "--eval_dataset=stdlib"], "--eval_dataset and --eval_split both choose"),
        (["--eval_split=0.1", "--eval_every=0"], "--eval_every=0 must be a positive integer"),
        (
            ["--eval_dataset=/no/such/eval.txt", "--dataset=synthetic", "--model=test", "--devices=1"],
            "/no/such/eval.txt",
        ),
        (["--eval_batches=3"], "--eval_batches needs something to evaluate: add --eval_split=0.01 or --eval_dataset"),
    ],
)
def test_bad_eval_flags_are_one_line_exit_2(args, message, capsys):
    from meshlm.cli import main

    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_too_few_held_out_rows_stops_before_any_compile(corpus, tmp_path, monkeypatch, capsys):
    from meshlm.cli import main

    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    with jax.log_compiles(True):
        code = main(
            [
                "train",
                "--model=test",
                f"--dataset={corpus}",
                "--eval_split=0.001",
                "--batch_size=8",
                "--seq_len=32",
                f"--output_dir={tmp_path / 'run'}",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "raise --eval_split" in err.splitlines()[-1], err
    assert not (tmp_path / "run" / "checkpoints" / "1").exists()
