"""The command line: bad input is one line naming the fix and exit code 2; a short real run works end to end."""

import json
from pathlib import Path

import pytest

from tests.support.cli import meshlm

BAD = [
    (["train", "--devices=8", "--mesh_dim=1,4,1,1"], "multiply to 4 but there are 8 devices"),
    (["train", "--devices=8", "--mesh_dim=-1,-1,1,1"], "only one axis may be -1"),
    (["train", "--devices=8", "--mesh_dim=1,0,8,1"], "0 is not a valid axis size"),
    (["train", "--devices=8", "--mesh_dim=1,a,8,1"], "'a' is not an integer"),
    (["train", "--devices=8", "--mesh_dim=xp:8"], "unknown axis 'xp'"),
    (["train", "--devices=8", "--mesh_dim=1,8,1,1", "--batch_size=1"], "--mesh_dim=1,1,1,8"),
    (["train", "--devices=8", "--mesh_dim=1,1,1,8", "--seq_len=100"], "seq_len 100 is not divisible by 2×sp = 16"),
    (["train", "--devices=8", "--mesh_dim=1,1,8,1", "--model=tiny"], "n_heads = 4 is not divisible by tp = 8"),
    (["train", "--devices=8", "--mp_mesh_dim=3,1"], "does not divide the 8 devices"),
    (["train", "--model=nope"], "neither a preset"),
    (["train", "--model.n_layerz=3"], "unknown model field"),
    (["train", "--model.n_layers=x"], "is not a valid int"),
    (["train", "--steps=0"], "--steps=0 must be a positive integer"),
    (["train", "--dtype=int8"], "--dtype=int8"),
    (["train", "--remat=sometimes", "--model=test", "--dataset=synthetic", "--devices=1"], "--remat='sometimes'"),
    (["train", "--bogus=1"], "unrecognized arguments: --bogus=1"),
    (["train", "--dataset=/no/such/file.txt", "--devices=1", "--model=test"], "/no/such/file.txt"),
    (["frobnicate"], "unknown command"),
    (["trian"], "did you mean meshlm train?"),
    (["train", "--mesh_dims=1,8,1,1"], "unknown flag --mesh_dims; did you mean --mesh_dim?"),
    (["explain", "--mesh_dims=1,8,1,1"], "did you mean --mesh_dim?"),
    (["plan", "--mesh_dims=1,8,1,1"], "did you mean --mesh_dim?"),
    (["generate", "--checkpoint=x", "--prompt=x", "--mesh_dims=1,8,1,1"], "did you mean --mesh_dim?"),
    (["serve", "--checkpoint=x", "--mesh_dims=1,8,1,1"], "did you mean --mesh_dim?"),
    (["export", "--checkpoint=x", "--ouut=y"], "did you mean --out?"),
    (["convert", "--to_hf=x", "--checkpoints=y"], "did you mean --checkpoint?"),
    (["train", "--model=llama3-8"], "did you mean --model=llama3-8b?"),
    (["train", "--model.n_layer=2"], "did you mean --model.n_layers?"),
    (["serve", "--checkpoint=x", "--host=10.99.99.99"], "--host=10.99.99.99 is not an address of this machine"),
    # whole flag names only: `--step` is the checkpoint step in generate and serve, not train's --steps
    (["train", "--step=5"], "unknown flag --step; did you mean --steps?"),
    (["explain", "--devices=8", "--mesh=1,4,2,1"], "unrecognized arguments: --mesh=1,4,2,1"),
    (
        ["explain", "--devices=8", "--model=test", "--tensor=layers/mlp/gat"],
        "--tensor=layers/mlp/gat: no such parameter; did you mean --tensor=layers/mlp/gate?",
    ),
    # a model field that is a flag of its own is set by the flag (which would otherwise override it)
    (["train", "--model.dtype=float16"], "--model.dtype: set it with --dtype=float16"),
    (["train", "--model.remat=bogus"], "--model.remat: set it with --remat=bogus"),
    (
        ["generate", "--checkpoint=/no/such", "--prompt=x", "--max_tokens=0"],
        "--max_tokens=0 must be a positive integer",
    ),
    (
        ["generate", "--checkpoint=/no/such", "--prompt=x", "--temperature=-1"],
        "--temperature must be a number >= 0 (0 is greedy), got -1.0",
    ),
    # a kernel the devices cannot run is refused before anything starts (no run folder, no compile)
    (
        ["train", "--model=test", "--dataset=synthetic", "--devices=1", "--attention=cudnn"],
        "--attention=cudnn runs on GPU only and this job runs on CPU",
    ),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    from meshlm.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("args,message", [BAD[0], BAD[5]], ids=["product", "batch"])
def test_bad_input_from_a_real_process(args, message):
    result = meshlm(*args, timeout=120)
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_version(capsys):
    from meshlm.cli import main, version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.split() == ["meshlm", version()]


def test_help_lists_every_command_with_one_line():
    from meshlm.cli import COMMANDS

    result = meshlm("--help", timeout=60)
    assert result.returncode == 0
    for command, (_, _, line) in COMMANDS.items():
        assert any(row.split() == [command, *line.split()] for row in result.stdout.splitlines()), command


def test_help_documents_every_flag():
    from meshlm.config import flag_fields

    result = meshlm("train", "--help", timeout=60)
    assert result.returncode == 0
    for f in flag_fields():
        if f.metadata.get("cli", True):
            assert f"--{f.name}" in result.stdout, f.name
            assert f.metadata.get("help"), f.name


@pytest.mark.slow
def test_train_end_to_end_on_a_mixed_mesh(tmp_path):
    """`meshlm train` on 8 simulated devices, 2,2,2,1, a local text corpus with its own BPE: every output is
    written and the loss falls."""
    import json as json_module
    import textwrap  # noqa: E401  (stdlib sources make a learnable little corpus)

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("json", "textwrap"):
        module = {"json": json_module, "textwrap": textwrap}[name]
        (corpus / f"{name}.txt").write_text(Path(module.__file__).read_text())
    out = tmp_path / "run"
    result = meshlm(
        "train",
        "--devices=8",
        "--mesh_dim=2,2,2,1",
        "--model=test",
        "--model.n_layers=1",
        f"--dataset={corpus}",
        "--steps=12",
        "--batch_size=8",
        "--seq_len=64",
        "--lr=1e-2",
        "--log_every=4",
        f"--output_dir={out}",
        "--peak_tflops=1",
        env={"MESHLM_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 12]
    for r in rows:
        assert {"step", "loss", "tokens_per_s", "tflops_per_device", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((out / "tb").iterdir())
    assert "--mesh_dim=2,2,2,1" in result.stdout


def test_mp_mesh_dim_prints_the_equivalent_mesh_dim(tmp_path, capsys):
    """In this process (8 simulated devices already): a fresh one is test_train_end_to_end_on_a_mixed_mesh's."""
    from meshlm.cli import main

    code = main(
        [
            "train",
            "--devices=8",
            "--mp_mesh_dim=2,1",
            "--fsdp",
            "--model=test",
            "--model.n_layers=1",
            "--dataset=synthetic",
            "--steps=1",
            "--batch_size=8",
            "--seq_len=32",
            f"--output_dir={tmp_path}",
            "--peak_tflops=1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "--mp_mesh_dim=2,1 --fsdp is --mesh_dim=1,4,2,1" in out


def test_explain_takes_every_train_flag(capsys):
    from meshlm.cli import main
    from meshlm.config import flag_fields

    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in [f"--{f.name}" for f in flag_fields() if f.metadata.get("cli", True)]:
        assert flag in out, flag
    for flag in ("--tensor", "--png", "--json"):
        assert flag in out, flag


@pytest.mark.slow
def test_train_with_a_preset_and_zero_stage_then_resume(tmp_path, capsys):
    """In this process, as test_mp_mesh_dim_prints_the_equivalent_mesh_dim."""
    from meshlm.cli import main

    args = [
        "train",
        "--devices=8",
        "--mesh_dim=2,1,4,1",
        "--strategy=fsdp_tp",
        "--zero_stage=2",
        "--model=test",
        "--dataset=synthetic",
        "--batch_size=8",
        "--seq_len=32",
        "--log_every=1",
        f"--output_dir={tmp_path}",
        "--peak_tflops=1",
    ]
    code = main([*args, "--steps=2"])
    first = capsys.readouterr().out
    assert code == 0, first[-3000:]
    assert "strategy: fsdp_tp+zero2" in first
    code = main([*args, "--steps=3"])
    second = capsys.readouterr().out
    assert code == 0, second[-3000:]
    assert "resumed from" in second and "step      3" in second


def test_mesh_devices_and_dtype_are_declared_once_for_every_command():
    """--mesh_dim, --devices and --dtype come from meshlm.config's sections in every command (serving's
    default mesh and words passed in), and no command rewrites argparse's actions."""
    for path in sorted((Path(__file__).resolve().parent.parent / "meshlm" / "cli").glob("*.py")):
        text = path.read_text()
        assert "._actions" not in text, path.name
        for flag in ("--mesh_dim", "--devices", "--dtype"):
            if (path.name, flag) != ("convert.py", "--dtype"):  # there: the dtype the weights are written in
                assert f'add_argument("{flag}"' not in text, (path.name, flag)
