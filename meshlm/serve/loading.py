"""A model ready to serve: weights placed on the mesh, its tokenizer and chat template.

    model, job = load_model("outputs/run")                       # a run's output_dir or one of its checkpoints
    model, job = load_model("exported/", mesh_dim="1,1,2,1")     # `meshlm export` / `meshlm convert` output
    model, job = load_model("hf:Llama-3.2-1B/", dtype="bfloat16")  # a Hugging Face folder (hf: is optional)
    model, job = load_model("outputs/lora", base="llama/")       # a LoRA run: its base + adapters, merged

The mesh, the dtype and the decode batch are checked by meshlm.job.resolve_serving against the
model's config before any weight is read. A LoRA run's checkpoint is merged on the mesh as it loads
(meshlm.serve.lora_loading); `base` replaces the base folder it recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshlm.data.chat_template import template_in_config
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig
from meshlm.models.policy import DEFAULT_POLICY, RunPolicy


@dataclass
class LoadedModel:
    cfg: ModelConfig
    placement: Any  # meshlm.models.placement.Placement
    params: Any
    tokenizer: Any  # meshlm.data.tokenizer.Tokenizer (or any object with encode/decode/eos_id)
    name: str
    chat_template: str | None = None


def _tokenizer_files(carried: tuple[Path, ...]) -> dict[str, Path]:
    return {f.name: f for f in carried}


def read_chat_template(files: dict[str, Path]) -> str | None:
    """The Jinja chat template shipped with a tokenizer (chat_template.jinja or tokenizer_config.json)."""
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].read_text()
    config = files.get("tokenizer_config.json")
    if config is None:
        return None
    return template_in_config(json.loads(config.read_text()))


def load_model(
    checkpoint: str | Path,
    *,
    mesh_dim: str = "1,1,-1,1",
    dtype: str = "auto",
    max_batch: int | None = None,
    max_seq_len: int | None = None,
    step: int | None = None,
    tokenizer: str | None = None,
    name: str | None = None,
    base: str | Path | None = None,
):
    """(LoadedModel, meshlm.job.Job): weights from any source meshlm reads, each device reading only
    its own shards, on the mesh `mesh_dim` of the devices JAX has. `base`: for a LoRA run's
    checkpoint, the base model folder when it is no longer where the run recorded it."""
    from meshlm.checkpoint.train_checkpoint import config_from_meta
    from meshlm.checkpoint.weights import open_source, parse_init_from
    from meshlm.data.tokenizer import Tokenizer
    from meshlm.job import resolve_serving
    from meshlm.serve.lora_loading import lora_meta, merged_params

    path = parse_init_from(str(checkpoint)) if str(checkpoint).startswith("hf:") else Path(checkpoint).expanduser()
    meta = lora_meta(path, step) if path.exists() else None
    if meta is not None:
        if base is not None and str(base).startswith("hf:"):
            base = Path(str(base)[3:]).expanduser()
        job = resolve_serving(
            config_from_meta(meta["model"]),
            mesh_dim=mesh_dim,
            dtype=dtype,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
        )
        params, carried = merged_params(job, path, step, meta, base)
        files = _tokenizer_files(carried)
    else:
        with open_source(path, step) as source:
            if base is not None:
                raise UsageError(
                    f"--base={base} is only for a LoRA run's checkpoint, and {path} holds whole weights; drop --base"
                )
            job = resolve_serving(
                source.cfg, mesh_dim=mesh_dim, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len
            )
            params = source.load(job.placement)
            files = _tokenizer_files(source.carried)
    cfg = job.model
    if tokenizer is not None:
        tok = Tokenizer.from_file(tokenizer)
        files = _tokenizer_files(tuple(p for p in Path(tok.path).parent.iterdir() if p.is_file()))
    elif "tokenizer.json" in files:
        tok = Tokenizer.from_file(files["tokenizer.json"])
    else:
        raise UsageError(f"{path} has no tokenizer.json beside its weights; pass --tokenizer=PATH/tokenizer.json")
    if tok.vocab_size > cfg.vocab_size:
        raise UsageError(
            f"the tokenizer has {tok.vocab_size} tokens but the model only {cfg.vocab_size}; "
            "pass the tokenizer this model was trained with (--tokenizer)"
        )
    model_name = name or (path.name if path.name not in ("checkpoints", "") and not path.name.isdigit() else str(path))
    return LoadedModel(cfg, job.placement, params, tok, model_name, read_chat_template(files)), job


def random_model(
    cfg: ModelConfig, mesh, tokenizer, *, seed: int = 0, name: str = "random", policy: RunPolicy = DEFAULT_POLICY
) -> LoadedModel:
    """Random weights of this shape (tests, benchmarks), run as `policy` says: the same values on every mesh
    for the same seed."""
    from meshlm.models.placement import place

    placement = place(cfg, mesh, policy=policy)
    return LoadedModel(cfg, placement, placement.init(seed), tokenizer, name)


__all__ = ["LoadedModel", "load_model", "random_model", "read_chat_template"]
