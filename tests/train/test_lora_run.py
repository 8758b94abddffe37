"""`meshlm train --lora_rank` end to end: fine-tune a Hugging Face base with the explicit ZeRO path, resume,
a checkpoint that holds the adapters (and names the base) but not the base, export to PEFT; bad flags."""

import json

import numpy as np
import pytest

from meshlm.cli import main
from tests.support.hf import small_hf_config, write_numpy_hf


@pytest.mark.slow
def test_lora_train_resume_export(tmp_path, capsys):
    """The commands run in this process (its 8 simulated devices), as `meshlm` runs them."""
    base = write_numpy_hf(tmp_path / "base", small_hf_config())
    run = tmp_path / "run"
    args = [
        "train",
        "--devices=8",
        "--mesh_dim=2,1,4,1",
        "--zero_stage=1",
        f"--init_from=hf:{base}",
        "--lora_rank=4",
        "--lora_alpha=8",
        "--dataset=synthetic",
        "--batch_size=8",
        "--seq_len=32",
        "--log_every=1",
        f"--output_dir={run}",
        "--peak_tflops=1",
    ]
    code = main([*args, "--steps=2"])
    first = capsys.readouterr()
    assert code == 0, first.err[-3000:]
    assert "LoRA: rank 4, alpha 8 on 7 weights" in first.out
    assert "without --init_from" not in first.out  # a real base: no note
    code = main([*args, "--steps=3"])
    second = capsys.readouterr()
    assert code == 0, second.err[-3000:]
    assert "resumed from" in second.out
    meta = json.loads((run / "checkpoints" / "3" / "meta" / "metadata").read_text())
    assert meta["lora"]["base"] == str(base) and meta["lora"]["rank"] == 4
    stored = json.loads((run / "checkpoints" / "3" / "state" / "_METADATA").read_text())
    keys = " ".join(stored["tree_metadata"])
    assert "lora" in keys and "'base'" not in keys and "embed" not in keys

    out = tmp_path / "peft"
    code = main(["export", f"--checkpoint={run}", f"--out={out}", "--lora_format=peft"])
    assert code == 0, capsys.readouterr().err[-3000:]
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2
    assert any(np.abs(v).max() > 0 for k, v in tensors.items() if "lora_B" in k)  # B trained away from zero


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lora_rank=-1"], "--lora_rank=-1 must be ≥ 0"),
        (["--lora_rank=4", "--lora_targets=("], "is not a regular expression"),
        (["--lora_rank=4", "--lora_base_dtype=float16"], "--lora_base_dtype=float16: choose float32 or bfloat16"),
        (["--lora_rank=4", "--lora_alpha=0"], "--lora_alpha=0.0 must be positive"),
        (["--lora_rank=4", "--lora_targets=norm"], "which is not a projection"),
        (["--lora_rank=4", "--lora_targets=nothing_here"], "matches no parameter"),
    ],
)
def test_bad_lora_flags_one_line(tmp_path, capsys, flags, says):
    code = main(["train", "--model=test", "--dataset=synthetic", "--steps=1", f"--output_dir={tmp_path}", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err, err


def test_lora_on_a_random_base_says_so(tmp_path, capsys):
    code = main(
        [
            "train",
            "--model=test",
            "--dataset=synthetic",
            "--devices=8",
            "--lora_rank=2",
            "--steps=1",
            "--batch_size=8",
            "--seq_len=32",
            f"--output_dir={tmp_path / 'run'}",
            "--peak_tflops=1",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "note: --lora_rank without --init_from: the frozen base is random weights (seed 0)" in out, out
