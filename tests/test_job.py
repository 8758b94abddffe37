"""The job layer (meshlm.job) runs every pre-compile check once for every command: the same bad input
gives the same one-line error from train, explain, plan --verify, generate and serve."""

import socket

import pytest

from meshlm.cli import main
from meshlm.config import TrainConfig
from meshlm.errors import UsageError
from tests.support.hf import small_hf_config, write_numpy_hf, write_tokenizer


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A Hugging Face folder (4 heads, 2 kv heads): weights, config.json and a tokenizer."""
    directory = tmp_path_factory.mktemp("hf")
    write_numpy_hf(directory, small_hf_config())
    write_tokenizer(directory)
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(model_dir, train_flags: list[str], serving_flags: list[str]) -> dict[str, list[str]]:
    """One bad input given to every command, each with the flags it takes for the same job (8 devices,
    8 sequences of 256 tokens in training, 8 decode slots of 256 tokens in serving); later flags win."""
    train = [f"--model={model_dir / 'config.json'}", "--devices=8", "--batch_size=8", "--seq_len=256", *train_flags]
    serving = [f"--checkpoint={model_dir}", "--devices=8", "--max_batch=8", "--max_seq_len=256", *serving_flags]
    return {
        "train": ["train", "--steps=1", "--dataset=synthetic", *train],
        "explain": ["explain", *train],
        "plan --verify": ["plan", "--hardware=cpu", "--verify=1", *train],
        "generate": ["generate", "--prompt=hello", *serving],
        "serve": ["serve", f"--port={_free_port()}", *serving],
    }


# case: (flags for train/explain/plan, flags for generate/serve, what the line says)
BAD = {
    "dtype": (["--dtype=float64"], ["--dtype=float64"], "--dtype=float64: choose auto, float32, bfloat16 or float16"),
    "malformed mesh": (["--mesh_dim=1,a,8,1"], ["--mesh_dim=1,a,8,1"], "'a' is not an integer"),
    "tp over the heads": (
        ["--mesh_dim=1,1,8,1"],
        ["--mesh_dim=1,1,8,1"],
        "--mesh_dim=1,1,8,1: n_heads = 4 is not divisible by tp = 8; meshes that work",
    ),
    # serving says it in its own flag's words (train: the batch; serve: the decode slots)
    "batch over the data axes": (
        ["--mesh_dim=8,1,1,1", "--batch_size=4"],
        ["--mesh_dim=8,1,1,1", "--max_batch=4"],
        "--mesh_dim=8,1,1,1: global batch size 4 is smaller than dp×fsdp = 8",
        "--max_batch=4 must be a positive multiple of dp×fsdp = 8 (try --max_batch=8)",
    ),
}
SERVING = ("generate", "serve")


@pytest.mark.parametrize("case", list(BAD))
def test_every_command_gives_the_same_error(case, hf_model, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the outputs of a run that got too far would land here
    train_flags, serving_flags, message, *serving_message = BAD[case]
    errors = {}
    for name, argv in commands(hf_model, train_flags, serving_flags).items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (name, err)
        errors[name] = err
    assert message in errors["train"], errors["train"]
    if not serving_message:
        assert len(set(errors.values())) == 1, errors
        return
    assert len({e for n, e in errors.items() if n not in SERVING}) == 1, errors
    assert {errors[n] for n in SERVING} == {f"error: {serving_message[0]}"}, errors


def test_resolve_builds_what_train_needs():
    from meshlm.job import resolve

    job = resolve(TrainConfig(model="test", mesh_dim="2,2,2,1", batch_size=8, seq_len=32))
    assert (job.shape.dp, job.shape.fsdp, job.shape.tp, job.shape.sp) == (2, 2, 2, 1)
    from meshlm.platform import resolve_dtype

    assert job.policy.dtype == resolve_dtype("auto", "cpu") and job.pipeline is None and job.strategy.name == "default"
    assert dict(job.mesh.shape) == {"dp": 2, "fsdp": 2, "tp": 2, "sp": 1}
    assert job.placement.cfg == job.model


def test_resolve_checks_the_context_for_every_command():
    from meshlm.job import resolve

    with pytest.raises(UsageError, match="exceeds the model's max_seq_len"):
        resolve(TrainConfig(model="test", seq_len=10**6), build=False)


def test_preset_names_in_any_case():
    from meshlm.job import resolve_model

    cfg = TrainConfig(model="Tiny")
    model, _ = resolve_model(cfg)
    assert cfg.model == "tiny" and model.d_model == 256


def test_serving_mesh_misfit_is_said_in_serving_terms():
    """A serving mesh the weights do not split over: plain words and meshes serve accepts (it has no
    --strategy), before anything is built."""
    from meshlm.job import resolve_serving
    from meshlm.models.presets import PRESETS

    model = PRESETS["test"].replace(d_model=60)  # 60 does not split over fsdp = 8
    with pytest.raises(UsageError) as err:
        resolve_serving(model, mesh_dim="1,8,1,1", build=False)
    msg = str(err.value)
    assert "d_model = 60 is not divisible by fsdp×sp = 8; meshes that work" in msg and "--mesh_dim=" in msg, msg
    assert "--strategy" not in msg and "spec" not in msg, msg
    with pytest.raises(UsageError) as err:
        resolve_serving(PRESETS["tiny"], mesh_dim="1,1,8,1", build=False)
    assert "n_heads = 4 is not divisible by tp = 8" in str(err.value) and "--mesh_dim=1,4,2,1" in str(err.value)
    with pytest.raises(UsageError, match=r"^--mesh_dim=1,1,-1,1 \(that is 1,1,8,1\): n_heads = 4 is not divisible"):
        resolve_serving(PRESETS["tiny"], mesh_dim="1,1,-1,1", build=False)  # the default, tp over every device
    for bad, words in (
        (0, r"--max_batch=0 must be a positive multiple of dp×fsdp = 4 \(try --max_batch=4\)"),
        (-4, "--max_batch=-4 must be a positive multiple"),
        (3, r"--max_batch=3 must be a positive multiple of dp×fsdp = 4 \(try --max_batch=4\)"),
    ):
        with pytest.raises(UsageError, match=words):
            resolve_serving(PRESETS["tiny"], mesh_dim="2,2,2,1", max_batch=bad, build=False)


def test_resolve_chooses_the_strategy_before_the_remat(monkeypatch):
    """model -> mesh -> strategy -> remat: a strategy that cannot split the batch is found before the
    memory model is asked for a remat policy."""
    from meshlm import job as joblib

    monkeypatch.setattr(joblib, "auto_remat", lambda *a, **k: pytest.fail("remat chosen before the strategy"))
    with pytest.raises(UsageError, match="--strategy=dp splits the batch over tp = 8 devices"):
        joblib.resolve(
            TrainConfig(model="test", strategy="dp", mesh_dim="1,1,8,1", batch_size=4, seq_len=32),
            build=False,
            output=False,
        )


def test_auto_remat_named_is_refused_where_the_planner_does_not_model_the_strategy(capsys):
    code = main(
        [
            "train",
            "--devices=8",
            "--model=test",
            "--dataset=synthetic",
            "--steps=1",
            "--batch_size=8",
            "--seq_len=32",
            "--strategy=fsdp",
            "--remat=auto",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--remat=auto with --strategy=fsdp: the memory model that chooses it plans only --strategy=default" in err[0]


def test_auto_remat_by_default_or_on_the_planned_strategy_is_chosen():
    from meshlm.job import resolve

    for cfg in (
        TrainConfig(model="test", strategy="fsdp", batch_size=8, seq_len=32),  # left at its default
        TrainConfig(model="test", remat="auto", batch_size=8, seq_len=32),
    ):
        assert resolve(cfg, build=False, output=False).policy.remat != "auto"
    with pytest.raises(UsageError, match="--remat=auto with --zero_stage=1"):
        resolve(TrainConfig(model="test", remat="auto", zero_stage=1, batch_size=8, seq_len=32), build=False)


def test_forced_kernel_is_checked_against_local_layers_and_soft_cap(monkeypatch):
    """A kernel forced by --attention must serve every kind of layer: Triton has no sliding window, cuDNN no
    logit soft cap; each is one line before anything compiles."""
    from meshlm.job import check_kernel
    from meshlm.models.policy import RunPolicy
    from meshlm.models.presets import resolve_model
    from meshlm.ops import kernels

    monkeypatch.setattr(kernels, "default_platform", lambda: "gpu")
    monkeypatch.setattr(kernels, "gpu_capability", lambda: 9.0)
    local = resolve_model("test", {"sliding_window": "16", "layer_pattern": "LG"})
    cudnn, triton = RunPolicy(dtype="bfloat16", attention="cudnn"), RunPolicy(dtype="bfloat16", attention="triton")
    check_kernel(local, cudnn, 64)  # cuDNN has a window
    with pytest.raises(UsageError, match="sliding-window"):
        check_kernel(local, triton, 64)
    with pytest.raises(UsageError, match="soft-cap"):
        check_kernel(local.replace(attn_logit_softcap=50.0), cudnn, 64)
    check_kernel(local.replace(sliding_window=0, layer_pattern=""), triton, 64)  # all global
