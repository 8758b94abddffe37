"""Hugging Face LLaMA weights in and out: same logits as transformers, sharded loads, bounded memory."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from meshlm.checkpoint.convert import convert_from_hf, convert_to_hf, save_params
from meshlm.checkpoint.hf_map import leaves
from meshlm.checkpoint.params_folder import PARAMS_FILE, ParamsSource
from meshlm.checkpoint.safetensors_io import INDEX_FILE
from meshlm.checkpoint.weights import load_params, parse_init_from, read_model_config
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, RopeScaling
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from tests.support.hf import (
    hf_folder_logits,
    hf_tensor_shapes,
    mesh_of,
    meshlm_logits,
    small_hf_config,
    tokens_for,
    torch_llama,
    torch_logits,
    write_numpy_hf,
    write_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# (HF config overrides, mesh): MHA, GQA with rope_theta != 10000 and Llama-3 scaling, tied GQA.
CASES = {
    "mha": (dict(num_attention_heads=4, num_key_value_heads=4), "1,2,4,1"),
    "gqa_theta_llama3": (
        dict(num_attention_heads=8, num_key_value_heads=4, rope_parameters={"rope_theta": 50000.0, **LLAMA3}),
        "2,2,2,1",
    ),
    "gqa_tied_theta": (
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        ),
        "1,8,1,1",
    ),
}


def assert_trees_equal(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------------ layout (no torch)


@pytest.mark.parametrize("tie", [False, True])
def test_leaf_table_matches_the_model(tie):
    cfg = ModelConfig(vocab_size=128, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_dim=96, tie_embeddings=tie)
    shapes = {
        jax.tree_util.keystr(p, simple=True, separator="."): tuple(s.shape)
        for p, s in jax.tree_util.tree_flatten_with_path(place(cfg, mesh_of("1,1,1,1")).shapes)[0]
    }
    assert {leaf.name: leaf.full_shape for leaf in leaves(cfg)} == shapes


def test_numpy_folder_maps_each_tensor_by_the_documented_layout(tmp_path):
    """bf16 Hugging Face tensors land transposed/reshaped where llama.py expects them, kept in bf16 on disk."""
    from safetensors import safe_open

    cfg_hf = small_hf_config(num_attention_heads=4, num_key_value_heads=2)
    src = write_numpy_hf(tmp_path / "hf", cfg_hf, dtype="bfloat16", per_layer_files=True)
    out = convert_from_hf(src, tmp_path / "p")
    E, H, K, D, M = 64, 4, 2, 16, 96
    with (
        safe_open(str(out / PARAMS_FILE), framework="numpy") as p,
        safe_open(str(src / "model-00003-of-00003.safetensors"), framework="numpy") as layer1,
        safe_open(str(src / "model-00001-of-00003.safetensors"), framework="numpy") as rest,
    ):
        assert p.get_tensor("layers.attn.wq").dtype == ml_dtypes.bfloat16
        q = layer1.get_tensor("model.layers.1.self_attn.q_proj.weight")  # [H*D, E]
        np.testing.assert_array_equal(p.get_tensor("layers.attn.wq")[1], q.T.reshape(E, H, D))
        k = layer1.get_tensor("model.layers.1.self_attn.k_proj.weight")
        np.testing.assert_array_equal(p.get_tensor("layers.attn.wk")[1], k.T.reshape(E, K, D))
        o = layer1.get_tensor("model.layers.1.self_attn.o_proj.weight")  # [E, H*D]
        np.testing.assert_array_equal(p.get_tensor("layers.attn.wo")[1], o.T.reshape(H, D, E))
        down = layer1.get_tensor("model.layers.1.mlp.down_proj.weight")  # [E, M]
        np.testing.assert_array_equal(p.get_tensor("layers.mlp.down")[1], down.T)
        assert p.get_tensor("layers.mlp.gate").shape == (2, E, M)
        np.testing.assert_array_equal(p.get_tensor("lm_head"), rest.get_tensor("lm_head.weight").T)
        np.testing.assert_array_equal(p.get_tensor("embed"), rest.get_tensor("model.embed_tokens.weight"))
    # Loading casts to the param dtype and gives the same values straight from the folder or from P.
    placement = place(read_model_config(out), mesh_of("2,2,2,1"))
    from_p, from_hf = load_params(out, placement), load_params(f"hf:{src}", placement)
    assert from_p["layers"]["attn"]["wq"].dtype == np.float32
    assert_trees_equal(from_p, from_hf)


def test_sharded_load_reads_only_device_slices(tmp_path):
    """Every device shard of a loaded leaf equals the matching slice of the leaf; nothing is replicated whole."""
    src = write_numpy_hf(tmp_path / "hf", small_hf_config(num_attention_heads=8, num_key_value_heads=4))
    out = convert_from_hf(src, tmp_path / "p")
    placement = place(read_model_config(out), mesh_of("1,2,4,1"))
    params = load_params(out, placement)
    wq = params["layers"]["attn"]["wq"]  # [L, E, H, D] sharded (None, fsdp, tp, None)
    leaf = next(leaf for leaf in leaves(placement.cfg) if leaf.name == "layers.attn.wq")
    full = ParamsSource(out).block(leaf, 1)
    assert wq.sharding.spec == placement.specs["layers"]["attn"]["wq"]
    shard = wq.addressable_shards[0]
    assert shard.data.shape == (2, 32, 2, 8)
    np.testing.assert_array_equal(np.asarray(shard.data)[1], full[shard.index[1:]])


# ----------------------------------------------------------------------------- logits (transformers)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    kw, mesh = CASES[case]
    model = torch_llama(small_hf_config(**kw))
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")  # carried along untouched
    out = convert_from_hf(tmp_path / "hf", tmp_path / "p")
    assert (out / "tokenizer" / "tokenizer.json").read_text() == "{}"

    cfg, f32 = read_model_config(out), RunPolicy(dtype="float32")
    assert cfg.rope_theta == kw.get("rope_parameters", {}).get("rope_theta", 10000.0)
    assert (cfg.rope_scaling is not None) == (case == "gqa_theta_llama3")
    placement = place(cfg, mesh_of(mesh), policy=f32)
    params = load_params(out, placement)
    assert_trees_equal(params, load_params(f"hf:{tmp_path / 'hf'}", placement))  # direct load: same arrays

    tokens = tokens_for(cfg.vocab_size)
    want = torch_logits(model, tokens)
    assert want.std() > 0.3  # large enough that a layout mistake could not hide under atol
    np.testing.assert_allclose(meshlm_logits(placement, params, tokens), want, atol=1e-4, rtol=0)
    if case == "gqa_theta_llama3":  # the scaling matters at this size: dropping it breaks the match
        plain = place(cfg.replace(rope_scaling=None), placement.mesh, policy=f32)
        assert np.abs(meshlm_logits(plain, params, tokens) - want).max() > 1e-3


def test_round_trip_meshlm_to_transformers(tmp_path):
    """meshlm params -> Hugging Face folder (sharded) -> transformers: same logits; and back: same params."""
    cfg = ModelConfig(
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        mlp_dim=96,
        max_seq_len=256,
        rope_theta=40000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
        norm_eps=1e-6,
        init_std=0.15,
    )
    placement = place(cfg, mesh_of("1,2,4,1"), policy=RunPolicy(dtype="float32"))
    params = placement.init(seed=3)
    tok_dir = write_tokenizer(tmp_path / "tok")
    p = save_params(params, cfg, tmp_path / "p", tokenizer_dir=tok_dir)
    hf_dir = convert_to_hf(p, tmp_path / "hf", max_shard_bytes=40_000)
    index = json.loads((hf_dir / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2 and set(index["weight_map"]) == set(
        hf_tensor_shapes(json.loads((hf_dir / "config.json").read_text()))
    )
    assert (hf_dir / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()

    tokens = tokens_for(cfg.vocab_size, seed=1)
    want = meshlm_logits(placement, params, tokens)
    np.testing.assert_allclose(hf_folder_logits(hf_dir, tokens), want, atol=1e-4, rtol=0)
    back = convert_from_hf(hf_dir, tmp_path / "back")
    assert read_model_config(back) == cfg
    assert_trees_equal(load_params(back, placement), params)
    assert (back / "tokenizer" / "tokenizer.json").is_file()


def test_bf16_export_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch_llama(small_hf_config(), dtype="bfloat16")
    model.save_pretrained(tmp_path / "hf")
    out = convert_from_hf(tmp_path / "hf", tmp_path / "p")
    hf_dir = convert_to_hf(out, tmp_path / "hf2")
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    import transformers

    again = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------------------- errors


def test_bad_inputs_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no such folder"):
        convert_from_hf(tmp_path / "nope", tmp_path / "p")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        convert_from_hf(tmp_path / "empty", tmp_path / "p")
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text(json.dumps(small_hf_config()))
    with pytest.raises(UsageError, match="safe_serialization=True"):
        convert_from_hf(bins, tmp_path / "p")
    with pytest.raises(UsageError, match="rope type 'dynamic' is not supported"):
        write_numpy_hf(tmp_path / "dyn", small_hf_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
        convert_from_hf(tmp_path / "dyn", tmp_path / "p")
    with pytest.raises(UsageError, match="no tensor model.layers.0.self_attn.q_proj.bias"):  # config has, files lack
        write_numpy_hf(tmp_path / "bias", small_hf_config(attention_bias=True))
        convert_from_hf(tmp_path / "bias", tmp_path / "p")

    good = write_numpy_hf(tmp_path / "good", small_hf_config())
    untied = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps({**untied, "num_hidden_layers": 3}))
    with pytest.raises(UsageError, match="no tensor model.layers.2"):
        convert_from_hf(good, tmp_path / "p")
    (good / "config.json").write_text(json.dumps(untied))
    out = convert_from_hf(good, tmp_path / "p")
    with pytest.raises(UsageError, match="already exists"):
        convert_from_hf(good, out)
    assert not list(tmp_path.glob(".*partial*"))  # failed conversions leave nothing behind

    wrong = place(
        ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_dim=96), mesh_of("1,1,1,1")
    )
    with pytest.raises(UsageError, match="n_kv_heads=2 but this run has n_kv_heads=4"):
        load_params(out, wrong)
    with pytest.raises(UsageError, match="hf:DIR"):
        parse_init_from("gs://bucket/model")
    with pytest.raises(UsageError, match="no config.json"):
        parse_init_from(f"hf:{tmp_path / 'empty'}")
    assert parse_init_from(f"hf:{good}") == good
    with pytest.raises(UsageError, match="none of"):
        load_params(tmp_path / "empty", wrong)

    truncated = tmp_path / "trunc"
    truncated.mkdir()
    (truncated / "config.json").write_text((good / "config.json").read_text())
    data = (good / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="does not fit the file"):
        convert_from_hf(truncated, tmp_path / "p2")


# ------------------------------------------------------------------------------------------- memory

MEMORY_PROBE = """
import json, sys
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
from meshlm.checkpoint.convert import convert_from_hf
base = status("VmRSS")
convert_from_hf(sys.argv[1], sys.argv[2])
print(json.dumps({"base": base, "peak": status("VmHWM"), "jax_imported": "jax" in sys.modules}))
"""

FIXED_OVERHEAD = 32 << 20  # beyond the interpreter with meshlm.checkpoint.convert imported (measured as `base`)


@pytest.mark.slow
def test_convert_peak_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """A 320 MiB model (stacked MLP leaves of 64 MiB, largest Hugging Face tensor 32 MiB) converts with
    peak RSS below base + 2 x 32 MiB + 32 MiB. VmHWM of a fresh process is the measure: getrusage's
    ru_maxrss survives exec and would report the parent's peak."""
    cfg = dict(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    src = write_numpy_hf(tmp_path / "hf", cfg, per_layer_files=True)
    shapes = hf_tensor_shapes(cfg)
    largest = max(int(np.prod(s)) for s in shapes.values()) * 4
    total = sum(int(np.prod(s)) for s in shapes.values()) * 4
    assert total >= 200 << 20 and largest == 32 << 20
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    print(
        f"convert of {total >> 20} MiB: interpreter {m['base'] >> 20} MiB, peak {m['peak'] >> 20} MiB "
        f"(+{(m['peak'] - m['base']) >> 20} MiB; largest tensor {largest >> 20} MiB)"
    )
    assert not m["jax_imported"]
    assert m["peak"] < m["base"] + 2 * largest + FIXED_OVERHEAD
    assert m["peak"] - m["base"] < total // 4  # far from holding the model (or one stacked 64 MiB leaf + copy)
    from safetensors import safe_open

    with (
        safe_open(str(tmp_path / "out" / PARAMS_FILE), framework="numpy") as p,
        safe_open(str(src / "model-00004-of-00005.safetensors"), framework="numpy") as layer2,
    ):
        gate = layer2.get_tensor("model.layers.2.mlp.gate_proj.weight")
        np.testing.assert_array_equal(p.get_slice("layers.mlp.gate")[2], gate.T)
