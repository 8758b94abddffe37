"""LoRA adapters out of a training checkpoint: a Hugging Face PEFT adapter folder, or merged full weights.

A LoRA run's checkpoint holds the adapters (params/lora) and optimizer state, not the frozen base; its
metadata's "lora" entry says the rank, alpha, targets and which base (the `--init_from` folder, or the
seed of a random one). `read_adapters` reads them back; `write_peft` writes `adapter_config.json` and
`adapter_model.safetensors` the way PEFT saves a LoRA adapter of a LlamaForCausalLM; `MergedSource` is
the base with W + (alpha / r)·A·B in the adapted weights, which `write_hf` (the `--to_hf` path) writes.

Layouts: meshlm's A [in..., r] and B [r, out...] (the weight's input and output axes, `meshlm.models.lora`)
are PEFT's lora_A.weight [r, in] and lora_B.weight [out, r] with the axes flattened in order: the same
flattening `hf_map` uses for the weight itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.checkpoint.folders import Staging, check_out
from meshlm.checkpoint.hf_folder import write_hf
from meshlm.checkpoint.hf_map import Leaf, get_path, leaves
from meshlm.checkpoint.origin import hf_base
from meshlm.checkpoint.safetensors_io import SafetensorsWriter, np_dtype
from meshlm.checkpoint.source import ArraySource, Source
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def read_adapters(checkpoint: str | Path, step: int | None = None) -> tuple[ModelConfig, dict, dict]:
    """(model config, the run's "lora" metadata, the adapters as one-stack numpy trees) of a LoRA checkpoint."""
    import orbax.checkpoint as ocp

    from meshlm.checkpoint.manager import Checkpointer, reads_that_may_fail
    from meshlm.checkpoint.train_checkpoint import config_from_meta, find_checkpoint

    directory, step, _ = find_checkpoint(checkpoint, step)
    where = directory / str(step)
    ckpt = Checkpointer(directory, async_save=False, read_only=True)
    try:
        with reads_that_may_fail():
            meta = ckpt.meta(step)
    finally:
        ckpt.close()
    if not meta.get("lora"):
        raise UsageError(f"checkpoint {where} holds no LoRA adapters (it trained every weight); export it without "
                         "--lora_format and --merge")
    state_dir = where / "state"
    with reads_that_may_fail():
        tree = ocp.PyTreeCheckpointHandler().metadata(state_dir)
        stored = getattr(tree, "tree", tree)["params"]["lora"]
        item = _map(stored, lambda _: 0)
        args = _map(stored, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
        restore = ocp.args.PyTreeRestore(item={"params": {"lora": item}}, restore_args={"params": {"lora": args}},
                                         partial_restore=True)
        adapters = ocp.PyTreeCheckpointer().restore(state_dir, args=restore)["params"]["lora"]
    return config_from_meta(meta["model"]), meta["lora"], _one_stack(adapters)


def _map(tree: Any, fn) -> Any:
    return {k: _map(v, fn) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def _one_stack(adapters: dict) -> dict:
    """Adapters saved in layer groups ({"layers": {"0-1": ..., "2-3": ...}}) joined into one stack."""
    layers = adapters.get("layers")
    if not layers or not all(re.fullmatch(r"\d+-\d+", k) for k in layers):
        return adapters
    keys = sorted(layers, key=lambda k: int(k.split("-")[0]))

    def join(*parts):
        return np.concatenate(parts) if not isinstance(parts[0], dict) else {k: join(*(p[k] for p in parts)) for k in parts[0]}

    return {**adapters, "layers": join(*(layers[k] for k in keys))}


def adapted_leaves(cfg: ModelConfig, adapters: dict) -> list[tuple[Leaf, np.ndarray, np.ndarray]]:
    """(leaf, A, B) of every weight with adapters; A [(L,) in..., r], B [(L,) r, out...]."""
    out = []
    for leaf in leaves(cfg):
        try:
            node = get_path(adapters, leaf.path)
        except (KeyError, TypeError):
            continue
        out_axes, in_axes = leaf.groups
        if len(leaf.groups) != 2 or list(in_axes) != list(range(len(in_axes))) or \
                list(out_axes) != list(range(len(in_axes), len(leaf.shape))):
            raise UsageError(f"{leaf.name} has adapters but is no projection that PEFT can adapt")
        out.append((leaf, np.asarray(node["a"]), np.asarray(node["b"])))
    return out


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
    modules = sorted({leaf.hf.removesuffix(".weight").rsplit(".", 1)[-1] for leaf, _, _ in adapted_leaves(cfg, adapters)})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]), "lora_dropout": 0.0, "target_modules": modules,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
    }


def write_peft(cfg: ModelConfig, lora: dict, adapters: dict, out: str | Path, base: str | None = None,
               dtype: str | None = None, flag: str = "--out") -> Path:
    """A PEFT adapter folder (`PeftModel.from_pretrained(base_model, out)` loads it). `lora`: {"rank",
    "alpha"}; `adapters`: one-stack numpy trees; `base`: the base model's folder or name, recorded."""
    out = Path(out).expanduser()
    check_out(out, flag)
    tensors = peft_tensors(cfg, adapters)
    dt = np_dtype(dtype) if dtype else np.dtype(np.float32)
    with Staging(out) as tmp:
        writer = SafetensorsWriter(tmp / ADAPTER_WEIGHTS, [(k, dt, v.shape) for k, v in tensors.items()], {"format": "pt"})
        try:
            for name, value in tensors.items():
                writer.write(name, value.astype(dt))
        finally:
            writer.close()
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg, lora, adapters, base), indent=2) + "\n")
    return out


class MergedSource(Source):
    """A base weight source with each adapted weight W read as W + scale·A·B (float32 arithmetic, stored in
    the base's dtype)."""

    def __init__(self, base: Source, adapters: dict, scale: float):
        self.base, self.cfg, self.where, self.carried = base, base.cfg, base.where, base.carried
        self.scale = scale
        self.adapted = {leaf.name: (a, b) for leaf, a, b in adapted_leaves(base.cfg, adapters)}

    def dtype(self, leaf: Leaf) -> np.dtype:
        return self.base.dtype(leaf)

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        w = self.base.block(leaf, layer)
        if leaf.name not in self.adapted:
            return w
        a, b = self.adapted[leaf.name]
        a, b = (a, b) if layer is None else (a[layer], b[layer])
        delta = np.tensordot(a.astype(np.float32), b.astype(np.float32), axes=([-1], [0]))
        return (np.asarray(w, np.float32) + self.scale * delta).astype(w.dtype)

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        whole = np.stack([self.block(leaf, i) for i in leaf.blocks()]) if leaf.layers else self.block(leaf, None)
        return whole[tuple(index)]

    def close(self) -> None:
        self.base.close()


def open_base(cfg: ModelConfig, lora: dict, base: str | Path | None = None) -> Source:
    """The base the adapters sit on: `base` if given, else the folder the checkpoint records, else the
    random weights of the recorded seed (rebuilt here)."""
    from meshlm.checkpoint.weights import check_compatible, open_source

    path = base if base is not None else lora.get("base")
    if path is not None:
        if not Path(path).expanduser().exists():
            raise UsageError(f"the base model {path} is not there; pass --base=DIR, the folder the adapters were "
                             "trained on")
        source = open_source(path)
        check_compatible(source.cfg, cfg, source.where)
        return source
    import jax

    from meshlm.mesh import MeshShape, build_mesh
    from meshlm.models.placement import place

    mesh = build_mesh(MeshShape(1, 1, 1, 1), jax.devices()[:1])
    placement = place(cfg.replace(param_dtype="float32"), mesh)
    params = jax.device_get(jax.jit(placement.random_params, static_argnums=0)(int(lora.get("base_seed", 0))))
    dt = np_dtype(lora.get("base_dtype", "float32"))
    return ArraySource(jax.tree.map(lambda a: np.asarray(a).astype(dt), params), cfg)


def export_peft(checkpoint: str | Path, out: str | Path, step: int | None = None, base: str | None = None,
                dtype: str | None = None) -> Path:
    """`meshlm export --lora_format=peft`: the checkpoint's adapters as a PEFT adapter folder, whose
    `base_model_name_or_path` is a Hugging Face folder (`--base`, or the run's `--init_from` folder, or the folder
    that params folder was converted from) so that `AutoPeftModelForCausalLM.from_pretrained(out)` loads it."""
    cfg, lora, adapters = read_adapters(checkpoint, step)
    recorded = base if base is not None else lora.get("base")
    name = hf_base(recorded) if recorded is not None else None  # a random base has no folder to name
    return write_peft(cfg, lora, adapters, out, name, dtype)


def export_merged(checkpoint: str | Path, out: str | Path, step: int | None = None, base: str | None = None,
                  dtype: str | None = None) -> Path:
    """`meshlm export --merge`: the base with the adapters merged in, as a Hugging Face folder."""
    cfg, lora, adapters = read_adapters(checkpoint, step)
    with MergedSource(open_base(cfg, lora, base), adapters, float(lora["alpha"]) / int(lora["rank"])) as source:
        return write_hf(source, out, dtype, flag="--out")


__all__ = ["read_adapters", "write_peft", "peft_tensors", "MergedSource", "open_base", "export_peft", "export_merged"]
