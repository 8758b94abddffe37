"""The run policy apart from the model: ModelConfig holds none of its fields, RunPolicy refuses bad values
in one line each, `--model.loss_chunk` (and its kin) on the command line land in the job's policy, and an
older checkpoint's model dict that still holds them is read."""

import dataclasses

import pytest

from meshlm import job as joblib
from meshlm.checkpoint.train_checkpoint import config_from_meta, policy_from_meta
from meshlm.cli.flags import split_model_overrides
from meshlm.config import TrainConfig
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig
from meshlm.models.policy import FIELDS, RunPolicy
from meshlm.models.presets import resolve_model

RUN_FIELDS = {"dtype", "param_dtype", "remat", "attention", "loss_chunk", "scan_unroll", "max_documents"}


def test_model_config_has_none_of_the_run_fields():
    assert not RUN_FIELDS & {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(FIELDS) == RUN_FIELDS


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(remat="bogus"), "--remat='bogus': choose one of none, save_dots"),
        (dict(loss_chunk=-1), "--model.loss_chunk=-1: give positions per loss chunk, or 0 for none"),
        (dict(scan_unroll=-1), "--model.scan_unroll=-1: give layers per loop iteration, or 0 for auto"),
        (dict(max_documents=0), "--model.max_documents=0 must be a positive integer"),
    ],
)
def test_bad_values_are_refused_in_one_line(changes, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")) as e:
        RunPolicy(**changes)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError):
        RunPolicy().replace(**changes)


def test_model_loss_chunk_on_the_command_line_lands_in_the_policy():
    argv, overrides = split_model_overrides(["--model.loss_chunk=256", "--model.n_layers=3", "--model.max_documents=4"])
    cfg = TrainConfig(model="test", batch_size=8, seq_len=32, model_overrides=overrides)
    job = joblib.resolve(cfg, build=False, output=False)
    assert job.policy.loss_chunk == 256 and job.policy.max_documents == 4 and job.model.n_layers == 3
    assert job.policy.dtype in ("float32", "bfloat16") and job.policy.remat != "auto"


def test_run_flags_given_as_model_fields_are_refused_as_before():
    with pytest.raises(UsageError, match="--model.dtype: set it with --dtype=float16"):
        split_model_overrides(["--model.dtype=float16"])
    with pytest.raises(UsageError, match="--model.loss_chunk='x' is not a valid int"):
        joblib.resolve_policy(TrainConfig(model_overrides={"loss_chunk": "x"}))


def test_an_older_checkpoints_model_dict_with_the_run_fields_is_read():
    model = resolve_model("test")
    old = {**dataclasses.asdict(model), "dtype": "float32", "remat": "full", "loss_chunk": 64}
    assert config_from_meta(old) == model
    assert policy_from_meta({"model": old}) == RunPolicy(dtype="float32", remat="full", loss_chunk=64)
    assert policy_from_meta({"model": old, "policy": {"dtype": "bfloat16"}}).dtype == "bfloat16"
