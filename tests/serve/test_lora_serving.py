"""`meshlm generate` on a LoRA run's checkpoint: the base with the adapters merged in at load time gives
the greedy text of the `meshlm export --merge` folder served as a plain Hugging Face folder, and not the
base's; a base that has moved is one line naming --base, and --base=DIR finds it."""

import contextlib
import io

import pytest

from meshlm.cli import main
from tests.support.hf import small_hf_config, write_numpy_hf

PROMPT = "def main("
FLAGS = ["--mesh_dim=4,1,2,1", "--max_tokens=12", "--temperature=0", "--max_seq_len=64"]


def generate(checkpoint, *flags) -> str:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["generate", f"--checkpoint={checkpoint}", f"--prompt={PROMPT}", *FLAGS, *flags]) == 0
    return text.getvalue()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A Hugging Face base (numpy weights, a byte-level tokenizer), two LoRA steps on it (adapters only,
    a high learning rate so that they matter), and the `export --merge` of the result."""
    from meshlm.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("lora_serving")
    base = write_numpy_hf(root / "base", small_hf_config(vocab_size=512))
    train_tokenizer("stdlib", 512, train_chars=400_000).save(base)
    run = root / "run"
    assert (
        main(
            [
                "train",
                "--mesh_dim=2,2,2,1",
                f"--init_from=hf:{base}",
                "--lora_rank=4",
                "--lora_alpha=8",
                "--dataset=synthetic",
                "--batch_size=4",
                "--seq_len=32",
                "--steps=2",
                "--lr=0.1",
                "--warmup_steps=1",
                "--log_every=1",
                f"--output_dir={run}",
                "--peak_tflops=1",
            ]
        )
        == 0
    )
    merged = root / "merged"
    assert main(["export", f"--checkpoint={run}", f"--out={merged}", "--merge"]) == 0
    return dict(root=root, base=base, run=run, merged=merged, want=generate(f"hf:{merged}"))


def test_lora_checkpoint_generates_as_its_merged_export(lora_run):
    want = lora_run["want"]
    assert want.startswith(PROMPT) and len(want) > len(PROMPT) + 1, want
    assert generate(lora_run["run"]) == want
    assert generate(lora_run["base"]) != want  # the adapters change the greedy text


def test_moved_base_is_one_line_naming_base_flag_and_base_flag_finds_it(lora_run, capsys):
    base, moved = lora_run["base"], lora_run["root"] / "moved_base"
    base.rename(moved)
    try:
        capsys.readouterr()
        code = main(["generate", f"--checkpoint={lora_run['run']}", f"--prompt={PROMPT}", *FLAGS])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "--base=DIR" in err and "\n" not in err, err
        assert generate(lora_run["run"], f"--base={moved}") == lora_run["want"]
    finally:
        moved.rename(base)


def test_base_flag_on_whole_weights_is_one_line(lora_run, capsys):
    code = main(
        ["generate", f"--checkpoint={lora_run['merged']}", f"--base={lora_run['base']}", f"--prompt={PROMPT}", *FLAGS]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "drop --base" in err and "\n" not in err, err
