"""Params out of training checkpoints (export, to Hugging Face) and fine-tuning from Hugging Face weights."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from meshlm.checkpoint.convert import convert_to_hf, export_params
from meshlm.checkpoint.hf_map import leaves
from meshlm.checkpoint.manager import Checkpointer
from meshlm.checkpoint.params_folder import PARAMS_FILE
from meshlm.checkpoint.train_checkpoint import find_checkpoint
from meshlm.checkpoint.weights import load_params, parse_init_from, read_model_config
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.train.state import TrainState, state_shardings
from meshlm.train.step import make_train_step, put_batch
from tests.support.hf import (
    hf_folder_logits,
    mesh_of,
    meshlm_logits,
    small_hf_config,
    tokens_for,
    torch_llama,
    torch_logits,
    write_tokenizer,
)

CFG = ModelConfig(
    vocab_size=128,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    mlp_dim=96,
    max_seq_len=128,
    rope_theta=30000.0,
    init_std=0.15,
)
POLICY = RunPolicy(dtype="bfloat16")  # the run's: what the export writes by default
STEP = 7


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A training run's output_dir as meshlm train leaves it: config.json, tokenizer/, checkpoints/7."""
    out = tmp_path_factory.mktemp("run")
    placement = place(CFG, mesh_of("2,2,2,1"), policy=POLICY)
    rng = np.random.default_rng(0)  # random values placed directly: no compile for the fixture
    params = jax.tree.map(
        lambda s, sh: jax.device_put(rng.normal(0, 0.15, s.shape).astype(s.dtype), sh),
        placement.shapes,
        placement.shardings,
    )
    optimizer = optax.adamw(1e-3)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    ckpt = Checkpointer(out / "checkpoints", async_save=False)
    meta = {"model": dataclasses.asdict(CFG), "policy": dataclasses.asdict(POLICY), "mesh_dim": "2,2,2,1"}
    ckpt.save(STEP, state, {"position": 0}, meta)
    ckpt.close()
    (out / "config.json").write_text(json.dumps({"model": dataclasses.asdict(CFG)}))  # not a Hugging Face config
    write_tokenizer(out / "tokenizer")
    return out, host(state.params)


def test_checkpoint_spellings(run, tmp_path):
    out, _ = run
    for spelling in (out, out / "checkpoints", out / "checkpoints" / str(STEP)):
        assert find_checkpoint(spelling) == (out / "checkpoints", STEP, out)
    with pytest.raises(UsageError, match="no step 3"):
        find_checkpoint(out, step=3)
    with pytest.raises(UsageError, match="holds no training checkpoint"):
        find_checkpoint(tmp_path)
    assert read_model_config(out) == CFG  # the full config, from the checkpoint's meta


def test_export_writes_params_only_in_the_compute_dtype(run, tmp_path):
    from safetensors import safe_open

    out, params = run
    p = export_params(out / "checkpoints", tmp_path / "p")
    assert sorted(f.name for f in p.iterdir()) == ["config.json", "params.safetensors", "tokenizer"]
    assert (p / "tokenizer" / "tokenizer.json").read_bytes() == (out / "tokenizer" / "tokenizer.json").read_bytes()
    assert json.loads((p / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(p / PARAMS_FILE), framework="numpy") as f:
        assert set(f.keys()) == {leaf.name for leaf in leaves(CFG)}  # no optimizer state, no step
        for leaf in leaves(CFG):
            got = f.get_tensor(leaf.name)
            assert got.dtype == ml_dtypes.bfloat16
            want = params
            for k in leaf.path:
                want = want[k]
            np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16))
    # Serving loads it onto another mesh, cast back to the param dtype.
    placement = place(CFG, mesh_of("1,4,2,1"), policy=POLICY)
    loaded = load_params(p, placement)
    assert loaded["embed"].sharding == placement.shardings["embed"]
    for a, b in zip(jax.tree.leaves(host(loaded)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert export_params(out, tmp_path / "p32", dtype="float32")
    with pytest.raises(UsageError, match="already exists"):
        export_params(out, p)
    with pytest.raises(UsageError, match="--dtype=int8"):
        export_params(out, tmp_path / "p8", dtype="int8")


def test_load_params_from_a_training_checkpoint_onto_another_mesh(run):
    out, params = run
    placement = place(CFG, mesh_of("8,1,1,1"), policy=POLICY)
    loaded = load_params(out, placement)
    assert jax.tree.map(lambda a: a.sharding, loaded) == placement.shardings
    for a, b in zip(jax.tree.leaves(host(loaded)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_training_checkpoint_to_transformers(run, tmp_path):
    out, params = run
    hf_dir = convert_to_hf(out, tmp_path / "hf", dtype="float32")
    assert (hf_dir / "tokenizer.json").is_file()
    cfg = CFG
    tokens = tokens_for(cfg.vocab_size)
    placement = place(cfg, mesh_of("1,1,1,1"), policy=RunPolicy(dtype="float32"))
    want = meshlm_logits(placement, jax.device_put(params, placement.shardings), tokens)
    np.testing.assert_allclose(hf_folder_logits(hf_dir, tokens), want, atol=1e-4, rtol=0)


def test_fine_tune_from_hugging_face_weights(tmp_path):
    """What `meshlm train --init_from=hf:DIR` does: the first step's loss is the Hugging Face model's loss."""
    torch = pytest.importorskip("torch")
    model = torch_llama(small_hf_config(rope_parameters={"rope_type": "default", "rope_theta": 25000.0}), seed=1)
    model.save_pretrained(tmp_path / "hf")
    path = parse_init_from(f"hf:{tmp_path / 'hf'}")
    cfg = read_model_config(path)
    placement = place(cfg, mesh_of("2,2,2,1"), policy=RunPolicy(dtype="float32"))
    optimizer = optax.adam(1e-2)
    params = load_params(path, placement)
    state = jax.jit(
        lambda p: TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p)),
        out_shardings=state_shardings(placement, optimizer),
    )(params)
    step = make_train_step(placement, optimizer)

    seq = tokens_for(cfg.vocab_size, (4, 17), seed=2)
    batch = {
        "inputs": seq[:, :-1],
        "targets": seq[:, 1:],
        "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
        "segment_ids": np.ones((4, 16), np.int32),
        "loss_mask": np.ones((4, 16), np.float32),
    }
    logits = torch.as_tensor(torch_logits(model, batch["inputs"]))
    targets = torch.as_tensor(seq[:, 1:]).reshape(-1).long()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets)
    losses = []
    for _ in range(3):
        state, metrics = step(state, put_batch(placement, batch))
        losses.append(float(metrics["loss"]))
    assert abs(losses[0] - float(want)) < 1e-4
    assert losses[2] < losses[0]
