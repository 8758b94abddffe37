"""Exact data resume: the loader's position is its step, so a run stopped at step N and resumed with
another process count or mesh reads the very token ids of the run that never stopped."""

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from meshlm.data import load_tokenizer, make_loader
from meshlm.train import step as train_step
from meshlm.train.loop import TrainConfig, train

SEQ, BATCH, STOP, STEPS = 16, 8, 5, 12
WORDS = "the a of model mesh shard token data loader batch row epoch seed step def return".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_data")
    for i, (name, n) in enumerate([("web", 80), ("code", 40)]):
        rng = np.random.default_rng(i)
        docs = [" ".join(rng.choice(WORDS, size=rng.integers(5, 60))) for _ in range(n)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "mix.toml").write_text(
        '[[sources]]\ndataset = "web.jsonl"\nweight = 3\n[[sources]]\ndataset = "code.jsonl"\nweight = 1\n'
    )
    return root


@pytest.fixture(scope="module")
def tok(corpus):
    return load_tokenizer(None, str(corpus / "web.jsonl"), 300, cache_dir=corpus / "cache")


def loaders(spec, tok, corpus, count, **kw):
    return [
        make_loader(spec, tok, SEQ, BATCH, p, count, seed=9, cache_dir=corpus / "cache", **kw) for p in range(count)
    ]


@pytest.mark.parametrize("dataset, eval_split", [("web.jsonl", None), ("web.jsonl", 0.1), ("mix.toml", 0.1)])
def test_every_process_count_reads_the_single_process_batches_before_and_after_restore(
    corpus, tok, dataset, eval_split
):
    spec = str(corpus / dataset)
    (single,) = loaders(spec, tok, corpus, 1, eval_split=eval_split)
    want = [next(single)["inputs"] for _ in range(STEPS)]  # more steps than an epoch of web.jsonl's rows
    for count in (2, 4):
        first = loaders(spec, tok, corpus, count, eval_split=eval_split)
        for step in range(STOP):
            got = np.concatenate([next(loader)["inputs"] for loader in first])
            np.testing.assert_array_equal(got, want[step])
        state = json.loads(json.dumps(first[0].state()))  # what a checkpoint holds
        for loader in first:
            loader.close()
        for other in (1, 2, 4):  # resumed with any process count
            resumed = loaders(spec, tok, corpus, other, eval_split=eval_split)
            for loader in resumed:
                loader.restore(state)
            for step in range(STOP, STEPS):
                got = np.concatenate([next(loader)["inputs"] for loader in resumed])
                np.testing.assert_array_equal(got, want[step])
            for loader in resumed:
                loader.close()
    single.close()


def config(out, corpus, tok, **kw):
    base = dict(
        model="test",
        dataset=str(corpus / "mix.toml"),
        tokenizer=str(tok.path),
        steps=4,
        batch_size=8,
        seq_len=32,
        log_every=1,
        lr=1e-2,
        output_dir=str(out),
        peak_tflops=1.0,
        dtype="float32",
        mesh_dim="1,8,1,1",
    )
    return TrainConfig(**{**base, **kw})


def test_a_run_resumed_on_another_mesh_reads_the_same_tokens(corpus, tok, tmp_path, monkeypatch):
    put_batch, seen, stop_at = train_step.put_batch, [], []

    def recording(placement, host_batch, perm):
        seen.append(host_batch["inputs"].copy())
        if len(seen) in stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves after this step and stops
        return put_batch(placement, host_batch, perm)

    monkeypatch.setattr(train_step, "put_batch", recording)
    train(config(tmp_path / "straight", corpus, tok))
    want, seen[:] = list(seen), []
    stop_at.append(2)
    first = train(config(tmp_path / "run", corpus, tok))
    assert first["interrupted"] == "SIGTERM" and first["checkpoint_step"] == 2
    stop_at.clear()
    second = train(config(tmp_path / "run", corpus, tok, mesh_dim="2,1,4,1"))
    assert second["first_step"] == 3 and len(seen) == 4
    for step in range(4):
        np.testing.assert_array_equal(seen[step], want[step])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("step") == 4 and "loss" in r][-1]
    assert last["tokens_web"] + last["tokens_code"] == 4 * 8 * 32 and last["tokens_web"] > last["tokens_code"]
    assert last["data_wait_ms"] >= 0
    assert Path(tmp_path / "run" / "checkpoints").is_dir()
