"""A LoRA run's adapters exported: a Hugging Face PEFT adapter folder, or the merged full weights.

`write_peft` writes `adapter_config.json` and `adapter_model.safetensors` the way PEFT saves a LoRA
adapter of any family's *ForCausalLM; `export_merged` writes the base with the adapters merged in
(`meshlm.checkpoint.lora_checkpoint.LoraCheckpoint`, a weight source) as a Hugging Face folder. meshlm's
A [in..., r] and B [r, out...] are PEFT's lora_A.weight [r, in] and lora_B.weight [out, r], the axes
flattened in order as `hf_map` flattens the weight itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshlm.checkpoint.folders import Staging, check_out
from meshlm.checkpoint.hf_folder import write_hf
from meshlm.checkpoint.lora_checkpoint import LoraCheckpoint, adapted_leaves, read_adapters
from meshlm.checkpoint.origin import hf_base
from meshlm.checkpoint.safetensors_io import SafetensorsWriter, np_dtype
from meshlm.models.configs import ModelConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_tensors(cfg: ModelConfig, adapters: dict) -> dict[str, np.ndarray]:
    """PEFT's tensor names and layouts: `base_model.model.<module>.lora_A.weight` [r, in] and `lora_B.weight`
    [out, r], one per layer of a stacked weight."""
    tensors = {}
    for leaf, a, b in adapted_leaves(cfg, adapters):
        for i in leaf.blocks():
            ai, bi = (a, b) if i is None else (a[i], b[i])
            module = PEFT_PREFIX + leaf.hf_name(i).removesuffix(".weight")
            rank = ai.shape[-1]
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(ai.reshape(-1, rank).T)
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(bi.reshape(rank, -1).T)
    return tensors


def peft_config(cfg: ModelConfig, lora: dict, adapters: dict, base: str | None) -> dict:
    modules = sorted(
        {leaf.hf.removesuffix(".weight").rsplit(".", 1)[-1] for leaf, _, _ in adapted_leaves(cfg, adapters)}
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"]),
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


def write_peft(
    cfg: ModelConfig,
    lora: dict,
    adapters: dict,
    out: str | Path,
    base: str | None = None,
    dtype: str | None = None,
    flag: str = "--out",
) -> Path:
    """A PEFT adapter folder (`PeftModel.from_pretrained(base_model, out)` loads it). `lora`: {"rank",
    "alpha"}; `adapters`: one-stack numpy trees; `base`: the base model's folder or name, recorded."""
    out = Path(out).expanduser()
    check_out(out, flag)
    tensors = peft_tensors(cfg, adapters)
    dt = np_dtype(dtype) if dtype else np.dtype(np.float32)
    with Staging(out) as tmp:
        writer = SafetensorsWriter(
            tmp / ADAPTER_WEIGHTS, [(k, dt, v.shape) for k, v in tensors.items()], {"format": "pt"}
        )
        try:
            for name, value in tensors.items():
                writer.write(name, value.astype(dt))
        finally:
            writer.close()
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, lora, adapters, base), indent=2) + "\n")
    return out


def export_peft(
    checkpoint: str | Path, out: str | Path, step: int | None = None, base: str | None = None, dtype: str | None = None
) -> Path:
    """`meshlm export --lora_format=peft`: the checkpoint's adapters as a PEFT adapter folder, whose
    `base_model_name_or_path` is a Hugging Face folder (`--base`, or the run's `--init_from` folder, or the folder
    that params folder was converted from) so that `AutoPeftModelForCausalLM.from_pretrained(out)` loads it."""
    cfg, lora, adapters = read_adapters(checkpoint, step)
    recorded = base if base is not None else lora.get("base")
    name = hf_base(recorded) if recorded is not None else None  # a random base has no folder to name
    return write_peft(cfg, lora, adapters, out, name, dtype)


def export_merged(
    checkpoint: str | Path, out: str | Path, step: int | None = None, base: str | None = None, dtype: str | None = None
) -> Path:
    """`meshlm export --merge`: the base with the adapters merged in, as a Hugging Face folder."""
    with LoraCheckpoint(checkpoint, step, base) as source:
        return write_hf(source, out, dtype, flag="--out")


__all__ = ["write_peft", "peft_tensors", "peft_config", "export_peft", "export_merged"]
