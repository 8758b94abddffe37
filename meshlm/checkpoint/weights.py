"""Weights from wherever they are: what `--init_from`, serving and convert call to open a model on disk.

`open_source(path)` picks the reader for a meshlm params folder, a training run or checkpoint folder, or a
Hugging Face folder; `parse_init_from` reads the `--init_from` spelling (`hf:DIR` or a path);
`read_model_config` is the model stored there; `load_params` places its parameters onto a mesh after
checking that their shapes fit the run's model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.checkpoint.folders import CONFIG_FILE
from meshlm.checkpoint.hf_folder import HFSource
from meshlm.checkpoint.params_folder import ParamsSource, is_params_folder
from meshlm.checkpoint.source import Source
from meshlm.checkpoint.train_checkpoint import TrainCheckpoint, is_train_checkpoint
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig

SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "tie_embeddings")


def open_source(path: str | Path, step: int | None = None) -> Source:
    """The right reader for a params folder, a training run/checkpoint folder or a Hugging Face folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{p} does not exist")
    if is_params_folder(p):
        return ParamsSource(p)
    if is_train_checkpoint(p):
        return TrainCheckpoint(p, step)
    if p.is_dir() and (p / CONFIG_FILE).is_file():
        return HFSource(p)
    raise UsageError(
        f"{p} is none of: a Hugging Face model folder (config.json + *.safetensors), a folder written by "
        "meshlm convert/export (params.safetensors), or a training run's output_dir / checkpoint folder"
    )


def parse_init_from(spec: str) -> Path:
    """`--init_from=hf:DIR` (a Hugging Face folder) or `--init_from=P` (meshlm convert/export output, a run)."""
    if spec.startswith("hf:"):
        path = Path(spec[3:]).expanduser()
        if not (path / CONFIG_FILE).is_file():
            raise UsageError(f"--init_from={spec}: {path} has no config.json; point at a Hugging Face model folder")
        return path
    if not spec or ":" in spec.split("/")[0]:
        raise UsageError(f"--init_from={spec!r}: use hf:DIR for a Hugging Face folder or a meshlm params folder's path")
    return Path(spec).expanduser()


def _strip_hf(path: str | Path) -> Path:
    return parse_init_from(path) if isinstance(path, str) and path.startswith("hf:") else Path(path)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model shape stored with any source (for `--init_from`: build the model from this, then override)."""
    with open_source(_strip_hf(path)) as source:
        return source.cfg


def check_compatible(stored: ModelConfig, wanted: ModelConfig, where: str) -> None:
    """The stored parameters' shapes must be the run's model's."""
    for f in SHAPE_FIELDS:
        a, b = getattr(stored, f), getattr(wanted, f)
        if a != b:
            raise UsageError(f"{where} holds a model with {f}={a} but this run has {f}={b}; pass --model.{f}={a}")


def load_params(path: str | Path, placement) -> Any:
    """Parameters from any source (`hf:DIR` too), each leaf placed straight into `placement.shardings`.

    Cast to the placement's param dtype. Only shapes must match `placement.cfg`; numerics such as rope_theta
    come from the run's config, so build it with `read_model_config(path)`."""
    with open_source(_strip_hf(path)) as source:
        check_compatible(source.cfg, placement.cfg, source.where)
        return source.load(placement)


__all__ = ["open_source", "parse_init_from", "read_model_config", "check_compatible", "load_params"]
