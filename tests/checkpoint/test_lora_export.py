"""LoRA adapters out of a checkpoint: a PEFT folder that peft loads onto the Hugging Face base with the same
logits as meshlm, merged weights equal to base + scale·B·A, and bad export flags as one line."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from meshlm.checkpoint.manager import Checkpointer
from meshlm.checkpoint.safetensors_io import read_header
from meshlm.checkpoint.weights import load_params, read_model_config
from meshlm.cli import main
from meshlm.models.lora import DEFAULT_TARGETS, LoraSpec, place_lora
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.train.state import TrainState, checkpointed
from meshlm.train.trainable import LoraTraining
from tests.support.hf import hf_folder_logits, mesh_of, meshlm_logits, small_hf_config, tokens_for, torch_llama
from tests.support.hf_families import torch_family

F32 = RunPolicy(dtype="float32")

SPEC = LoraSpec(rank=4, alpha=8.0, targets=DEFAULT_TARGETS + "|^lm_head$")
HF = small_hf_config()


def lora_run(root, model):
    """A Hugging Face base folder saved from `model`, and a LoRA run's checkpoint on it with random (non-zero)
    A and B; with the meshlm logits of the merged and of the base model."""
    model.save_pretrained(root / "base")
    cfg = read_model_config(root / "base")
    placement = place(cfg, mesh_of("1,2,2,1"), policy=F32)
    lora = place_lora(placement, SPEC)
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(
        lambda s, sh: jax.device_put(rng.normal(0, 0.2, s.shape).astype(s.dtype), sh), lora.shapes, lora.shardings
    )
    base = load_params(root / "base", placement)
    state = TrainState(jnp.zeros((), jnp.int32), {"base": base, "lora": adapters}, optax.adamw(1e-3).init(adapters))

    def save(base, name):
        """The run's checkpoint in root/name, recording `base` as its --init_from folder."""
        ckpt = Checkpointer(root / name / "checkpoints", async_save=False)
        trainable = LoraTraining(lora)
        ckpt.save(
            3,
            checkpointed(state, trainable),
            {"position": 0},
            {"model": dataclasses.asdict(cfg), **trainable.meta(base, 0)},
        )
        ckpt.close()
        return root / name

    save(root / "base", "run")
    tokens = tokens_for(cfg.vocab_size)
    logits = meshlm_logits(placement, jax.jit(lora.merge)(base, adapters), tokens)
    base_logits = meshlm_logits(placement, base, tokens)
    return dict(root=root, cfg=cfg, tokens=tokens, logits=logits, base_logits=base_logits, save=save)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return lora_run(tmp_path_factory.mktemp("lora"), torch_llama(HF))


def peft_logits(base: Path, adapter: Path, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits of the base folder with the PEFT adapter folder loaded onto it by peft."""
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32, attn_implementation="eager"
    )
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def test_peft_adapter_loads_in_peft_with_meshlm_logits(run):
    out = run["root"] / "peft"
    assert main(["export", f"--checkpoint={run['root'] / 'run'}", f"--out={out}", "--lora_format=peft"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and "lm_head" in config["target_modules"]
    names = read_header(out / "adapter_model.safetensors")
    E, H, D = HF["hidden_size"], HF["num_attention_heads"], HF["hidden_size"] // HF["num_attention_heads"]
    prefix = "base_model.model.model.layers.1."
    assert names[prefix + "self_attn.o_proj.lora_A.weight"].shape == (4, H * D)
    assert names[prefix + "self_attn.o_proj.lora_B.weight"].shape == (E, 4)
    assert names[prefix + "mlp.down_proj.lora_A.weight"].shape == (4, HF["intermediate_size"])
    got = peft_logits(run["root"] / "base", out, run["tokens"])
    assert np.abs(run["logits"] - run["base_logits"]).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(got, run["logits"], atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2"])
def test_peft_adapter_of_another_family_loads_with_meshlm_logits(family, tmp_path):
    """Biases (Qwen2), q/k norms (Qwen3), post-norms and soft-caps (Gemma 2) stay in the base; the adapter on
    its projections loads in peft with meshlm's merged logits."""
    run = lora_run(tmp_path, torch_family(family))
    out = tmp_path / "peft"
    assert main(["export", f"--checkpoint={tmp_path / 'run'}", f"--out={out}", "--lora_format=peft"]) == 0
    got = peft_logits(tmp_path / "base", out, run["tokens"])
    assert np.abs(run["logits"] - run["base_logits"]).max() > 1e-2
    np.testing.assert_allclose(got, run["logits"], atol=1e-4)


def test_merged_export_is_base_plus_adapter(run):
    from safetensors.numpy import load_file

    root = run["root"]
    peft_dir, merged = root / "peft_for_merge", root / "merged"
    assert main(["export", f"--checkpoint={root / 'run'}", f"--out={peft_dir}", "--lora_format=peft"]) == 0
    assert main(["export", f"--checkpoint={root / 'run'}", f"--out={merged}", "--merge"]) == 0
    base, lora = (
        load_file(str(root / "base" / "model.safetensors")),
        load_file(str(peft_dir / "adapter_model.safetensors")),
    )
    out = load_file(str(merged / "model.safetensors"))
    assert set(out) == set(base)
    adapted = 0
    for name, w in base.items():
        module = "base_model.model." + name.removesuffix(".weight")
        want = w
        if f"{module}.lora_A.weight" in lora:
            want = w + (8.0 / 4) * lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"]
            adapted += 1
        np.testing.assert_allclose(out[name], want, atol=1e-5, err_msg=name)
    assert adapted == 7 * HF["num_hidden_layers"] + 1
    np.testing.assert_allclose(hf_folder_logits(merged, run["tokens"]), run["logits"], atol=1e-4)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lora_format=gguf"], "--lora_format=gguf: the one format is peft"),
        (["--lora_format=peft", "--merge"], "pass one of them"),
        (["--base=x"], "add --lora_format=peft or --merge"),
        ([], "--lora_format=peft writes the adapters"),
    ],
)
def test_bad_export_flags_one_line(run, tmp_path, capsys, flags, says):
    code = main(["export", f"--checkpoint={run['root'] / 'run'}", f"--out={tmp_path / 'o'}", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err, err


def test_peft_export_after_convert_names_the_hugging_face_base(run, capsys):
    """The convert-first flow (`convert --from_hf` then `--init_from=PARAMS`): the adapter's base is the Hugging
    Face folder the params folder came from, so AutoPeftModelForCausalLM loads it from the adapter alone."""
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    root = run["root"]
    assert main(["convert", f"--from_hf={root / 'base'}", f"--out={root / 'params'}"]) == 0
    checkpoint = run["save"](root / "params", "run_on_params")
    out = root / "peft_from_params"
    assert main(["export", f"--checkpoint={checkpoint}", f"--out={out}", "--lora_format=peft"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((root / "base").absolute())
    model = peft.AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got = model.eval()(torch.as_tensor(run["tokens"], dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(got, run["logits"], atol=1e-4)

    # A params folder with no recorded origin: one line naming --base, nothing written; --base fixes it.
    (root / "params" / "converted_from.json").unlink()
    capsys.readouterr()
    code = main(["export", f"--checkpoint={checkpoint}", f"--out={root / 'peft2'}", "--lora_format=peft"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "give --base=DIR" in err and "\n" not in err, err
    assert not (root / "peft2").exists()
    assert (
        main(
            [
                "export",
                f"--checkpoint={checkpoint}",
                f"--out={root / 'peft2'}",
                "--lora_format=peft",
                f"--base={root / 'base'}",
            ]
        )
        == 0
    )


def test_lora_checkpoint_is_a_weight_source_merged_alike_on_host_and_mesh(run):
    """One reader for LoRA checkpoints: its host blocks (what --merge writes) and its placement on a mesh
    (what serving loads) hold the same merged weights, whose logits are the run's."""
    from meshlm.checkpoint.hf_map import get_path, leaves
    from meshlm.checkpoint.lora_checkpoint import LoraCheckpoint, lora_meta
    from meshlm.checkpoint.source import Source

    assert lora_meta(run["root"] / "run")["lora"]["rank"] == 4
    assert lora_meta(run["root"] / "base") is None
    placement = place(run["cfg"], mesh_of("1,2,2,1"), policy=F32)
    with LoraCheckpoint(run["root"] / "run") as source:
        assert isinstance(source, Source)
        on_mesh = jax.device_get(source.load(placement))
        for leaf in leaves(source.cfg):
            host = np.stack([source.block(leaf, i) for i in leaf.blocks()]) if leaf.layers else source.block(leaf, None)
            np.testing.assert_allclose(get_path(on_mesh, leaf.path), host, rtol=1e-6, atol=1e-6, err_msg=leaf.name)
    np.testing.assert_allclose(meshlm_logits(placement, on_mesh, run["tokens"]), run["logits"], atol=1e-4)
