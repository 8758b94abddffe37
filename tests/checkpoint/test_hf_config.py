"""One reading of a Hugging Face config.json: `--model=`, `--init_from=hf:`, convert and a params folder refuse
the same bad config with the same one-line error."""

import json

import pytest

from meshlm.checkpoint.convert import convert_from_hf
from meshlm.checkpoint.params_folder import PARAMS_FILE
from meshlm.checkpoint.weights import read_model_config
from meshlm.errors import UsageError
from meshlm.models.hf_config import from_hf_config, read_hf_config
from meshlm.models.presets import resolve_model
from tests.support.hf import small_hf_config, write_numpy_hf

BAD = {
    "moe": (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), "model_type='mixtral' is not a family"),
    "gelu": (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported; meshlm runs silu, gelu_pytorch_tanh"),
    "dynamic": (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic' is not supported"),
    "layer_types": (
        dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]),
        "layer_types must list",
    ),
}


def error_of(fn, *args) -> str:
    with pytest.raises(UsageError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("case", list(BAD))
def test_every_reader_refuses_a_bad_config_with_the_same_line(case, tmp_path):
    changes, fragment = BAD[case]
    hf_dir = write_numpy_hf(tmp_path / "hf", small_hf_config())  # real weights: only the config is wrong
    config = hf_dir / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | changes))
    params_dir = tmp_path / "params"  # a params folder whose config.json is the same bad one
    params_dir.mkdir()
    (params_dir / "config.json").write_text(config.read_text())
    (params_dir / PARAMS_FILE).write_bytes(b"")

    want = error_of(resolve_model, str(config))  # meshlm train --model=hf/config.json
    assert want.startswith(f"{config}") and fragment in want and "\n" not in want
    assert error_of(resolve_model, str(hf_dir), {"n_layers": "3"}) == want  # --model=hf (the folder)
    assert error_of(convert_from_hf, hf_dir, tmp_path / "out") == want  # meshlm convert --from_hf=hf
    assert error_of(read_model_config, f"hf:{hf_dir}") == want  # --init_from=hf:hf (and serve --checkpoint)
    assert error_of(read_model_config, str(hf_dir)) == want
    assert error_of(read_model_config, str(params_dir)) == want.replace(str(config), str(params_dir / "config.json"))
    assert not (tmp_path / "out").exists()


def test_good_config_reads_the_same_everywhere(tmp_path):
    hf_dir = write_numpy_hf(tmp_path / "hf", small_hf_config(rope_theta=20000.0))
    cfg = read_hf_config(hf_dir / "config.json")
    assert cfg.rope_theta == 20000.0 and cfg.n_kv_heads == 2
    assert resolve_model(str(hf_dir)) == cfg
    assert read_model_config(f"hf:{hf_dir}") == cfg
    assert read_model_config(convert_from_hf(hf_dir, tmp_path / "p")) == cfg


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{nope")
    assert error_of(read_hf_config, bad).startswith(f"{bad} is not valid JSON")
    assert error_of(resolve_model, str(bad)) == error_of(read_hf_config, bad)
    bad.write_text("[1, 2]")
    assert "not a config.json" in error_of(resolve_model, str(tmp_path))
    assert error_of(from_hf_config, {"model_type": "llama"}) == (
        "config.json lacks the field 'num_attention_heads' that a LlamaConfig has"
    )


def test_a_misspelt_field_and_a_run_config_are_named(tmp_path):
    """A field the file has under a near name is pointed at; the settings file of a meshlm run (not a
    model config) says which flags take that run."""
    hf = dict(small_hf_config())
    hf["num_hidden_layer"] = hf.pop("num_hidden_layers")
    assert error_of(from_hf_config, hf) == (
        "config.json lacks the field 'num_hidden_layers' that a LlamaConfig has "
        "(it has 'num_hidden_layer': a misspelling?)"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {}, "mesh_dim": "1,8,1,1", "train": {}}))
    assert error_of(read_hf_config, run / "config.json") == (
        f"{run / 'config.json'} is a meshlm run's settings, not a model config; start from its weights with "
        f"--init_from={run}, or continue the run with --output_dir={run}"
    )
