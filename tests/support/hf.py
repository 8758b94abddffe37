"""Helpers for the weight-conversion tests: Hugging Face folders made with numpy or with transformers."""

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlm.mesh import MeshShape, build_mesh


def mesh_of(sizes: str):
    shape = MeshShape(*(int(s) for s in sizes.split(",")))
    return build_mesh(shape, jax.devices()[: shape.n_devices])


def hf_tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """LlamaForCausalLM tensor names and shapes for a config.json dict (written independently of meshlm)."""
    E, V, M, L = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    H, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    D = hf.get("head_dim") or E // H
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
    if not hf.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, E)
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (E,),
            p + "post_attention_layernorm.weight": (E,),
            p + "self_attn.q_proj.weight": (H * D, E),
            p + "self_attn.k_proj.weight": (K * D, E),
            p + "self_attn.v_proj.weight": (K * D, E),
            p + "self_attn.o_proj.weight": (E, H * D),
            p + "mlp.gate_proj.weight": (M, E),
            p + "mlp.up_proj.weight": (M, E),
            p + "mlp.down_proj.weight": (E, M),
        }
    return shapes


def write_numpy_hf(directory: Path, hf: dict, dtype="float32", seed=0, per_layer_files=False) -> Path:
    """A Hugging Face folder made with numpy and `safetensors.numpy.save_file`, one file per layer if asked
    (with model.safetensors.index.json), so the whole model is never in memory at once."""
    import ml_dtypes
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    shapes = hf_tensor_shapes(hf)

    def tensor(shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(np_dt)

    groups: dict[str, list[str]] = {}
    for name in shapes:
        key = name.split(".")[2] if per_layer_files and name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    weight_map = {}
    for k, names in enumerate(groups.values()):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" if per_layer_files else "model.safetensors"
        save_file({n: tensor(shapes[n]) for n in names}, str(directory / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, fname)
    if per_layer_files:
        total = sum(math.prod(s) * np.dtype(np_dt).itemsize for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **hf}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def small_hf_config(**kw) -> dict:
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    return base | kw


def torch_llama(hf_kwargs: dict, seed: int = 0, dtype: str = "float32"):
    """A random LlamaForCausalLM (transformers, PyTorch CPU) with weights large enough that layout bugs show."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**hf_kwargs, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.to(getattr(torch, dtype))


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def hf_folder_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    """Logits of a folder loaded by transformers the way a user would: AutoModelForCausalLM.from_pretrained."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return torch_logits(model, tokens)


def meshlm_logits(placement, params, tokens: np.ndarray) -> np.ndarray:
    # Replicated logits: left to the compiler, JAX 0.12 may pick a layout it cannot name on the mesh.
    fn = jax.jit(
        lambda p, t: placement.apply(p, t),
        out_shardings=jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec()),
    )
    return np.asarray(fn(params, jax.numpy.asarray(tokens, jax.numpy.int32)))


def tokens_for(vocab: int, shape=(2, 24), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def write_tokenizer(directory: Path) -> Path:
    """A tiny word-level tokenizer.json made with the `tokenizers` library (a meshlm dependency)."""
    import tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    return directory
