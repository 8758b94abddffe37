"""`meshlm data prepare`: bad input is one line and exit code 2; two processes prepare one corpus together."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from meshlm.cli import main
from meshlm.data.corpus import open_corpus
from meshlm.data.shards import MANIFEST, TokenShards
from meshlm.data.tokenizer import train_tokenizer
from tests.data.test_prepare import make_corpus, reference_ids
from tests.support.cli import ROOT

BAD = [
    (["data"], "no action: write meshlm data prepare [flags]"),
    (["data", "prepair"], "unknown action 'prepair'"),
    (["data", "prepare", "--datset=x"], "did you mean --dataset?"),
    (["data", "prepare", "--dataset=/no/such/file.txt"], "/no/such/file.txt"),
    (["data", "prepare", "--dataset=synthetic"], "nothing to prepare"),
    (["data", "prepare", "--num_processes=2", "--process_id=2"], "--process_id=2 must be in 0 .. 1"),
    (["data", "prepare", "--workers=0"], "--workers=0 must be a positive integer"),
    (["data", "prepare", "--unit_mb=0"], "--unit_mb=0.0 must be positive"),
    (["data", "prepare", "--text_field= "], "--text_field is empty"),
    (["data", "prepare", "--tokenizer=/no/such/dir"], "tokenizer '/no/such/dir' not found"),
    (["data", "prepare", "--model=llama3-8"], "did you mean --model=llama3-8b?"),
    (["data", "prepare", "--vocab_size=1"], "--vocab_size=1 must be at least 2"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main([*argv, f"--cache_dir={tmp_path}"] if len(argv) > 2 else argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err


def test_the_default_tokenizer_is_the_bpe_train_trains(tmp_path, capsys):
    spec = make_corpus(tmp_path / "corpus")
    assert main(["data", "prepare", f"--dataset={spec}", "--vocab_size=300", f"--cache_dir={tmp_path}"]) == 0
    tok = train_tokenizer(spec, 300, cache_dir=tmp_path)  # the one just trained, from the cache
    (folder,) = (tmp_path / "shards").iterdir()
    np.testing.assert_array_equal(np.asarray(TokenShards(folder)), reference_ids(spec, tok))
    assert f"-> {folder}" in capsys.readouterr().err


def test_two_processes_prepare_one_corpus_together(tmp_path):
    spec = make_corpus(tmp_path / "corpus", n_files=6)
    tok = train_tokenizer(spec, 300, cache_dir=tmp_path / "cache")
    tok_dir = tmp_path / "tok"
    tok.save(tok_dir)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = [f"--dataset={spec}", f"--tokenizer={tok_dir}", f"--cache_dir={tmp_path / 'cache'}", "--workers=1"]
    n = len(open_corpus(spec).units(int(0.001 * 2**20)))
    assert n >= 6
    common.append("--unit_mb=0.001")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "meshlm", "data", "prepare", *common, f"--process_id={p}", "--num_processes=2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for p in (0, 1)
    ]
    logs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert f"{n} units ({(n + 1) // 2} encoded now)" in logs[0][1] and f"{n} units ({n // 2} encoded now)" in logs[1][1]
    folders = {line.rsplit("-> ", 1)[1] for _, err in logs for line in err.splitlines() if "-> " in line}
    assert len(folders) == 1
    manifest = json.loads((tmp_path / "cache" / "shards").joinpath(folders.pop().split("/")[-1], MANIFEST).read_text())
    assert [u["process"] for u in manifest["units"]] == [i % 2 for i in range(n)]
    shards = TokenShards(next((tmp_path / "cache" / "shards").iterdir()))
    np.testing.assert_array_equal(np.asarray(shards), reference_ids(spec, tok))


def test_prepare_a_mixture_prepares_each_source_for_training(tmp_path, monkeypatch):
    """`meshlm data prepare --dataset=mix.toml` prepares every source; a loader of the mixture then encodes nothing."""
    from meshlm.data import load_tokenizer, make_loader
    from meshlm.data import prepare as prep

    for name, n in (("a", 30), ("b", 12)):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"text": "{name} document {i} " }}\n' * 3 for i in range(n)))
    mix = tmp_path / "mix.toml"
    mix.write_text('[[sources]]\ndataset = "a.jsonl"\nweight = 2\n[[sources]]\ndataset = "b.jsonl"\nweight = 1\n')
    cache = tmp_path / "cache"
    assert main(["data", "prepare", f"--dataset={mix}", "--vocab_size=300", f"--cache_dir={cache}"]) == 0
    assert len(list((cache / "shards").glob("*/manifest.json"))) == 2
    tok = load_tokenizer(None, str(mix), 300, cache_dir=cache)
    encoded = []
    monkeypatch.setattr(prep, "_encode_units", lambda *a, **k: encoded.append(a))
    loader = make_loader(str(mix), tok, 8, 4, cache_dir=cache, prefetch=0)
    assert encoded == [] and next(loader)["inputs"].shape == (4, 8)
