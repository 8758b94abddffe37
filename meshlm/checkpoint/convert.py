"""The operations behind `meshlm convert` and `meshlm export`, as library calls (no flag parsing here).

`convert_from_hf`: a Hugging Face folder -> a meshlm params folder. `convert_to_hf`: a params folder or a
training checkpoint -> a Hugging Face folder. `export_params`: a training checkpoint -> a params folder in the
model's compute dtype (params only, no optimizer state: what serving loads). `save_params`: parameters in
memory -> a params folder. Each streams tensor by tensor and writes its output atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.checkpoint.hf_folder import DEFAULT_SHARD_BYTES, HFSource, write_hf
from meshlm.checkpoint.params_folder import write_params
from meshlm.checkpoint.source import ArraySource
from meshlm.checkpoint.weights import open_source
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig


def convert_from_hf(hf_dir: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """`meshlm convert --from_hf=DIR --out=P`: a meshlm params folder at P (dtype: keep the file's by default)."""
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise UsageError(f"--from_hf={hf_dir}: no such folder; point at a Hugging Face model folder")
    with HFSource(hf_dir) as source:
        return write_params(source, out, dtype, flag="--out")


def convert_to_hf(
    checkpoint: str | Path,
    hf_dir: str | Path,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    step: int | None = None,
) -> Path:
    """`meshlm convert --to_hf=DIR --checkpoint=P`: P is a params folder, a training run or checkpoint folder."""
    with open_source(checkpoint, step) as source:
        return write_hf(source, hf_dir, dtype, max_shard_bytes)


def export_params(checkpoint: str | Path, out: str | Path, dtype: str | None = None, step: int | None = None) -> Path:
    """`meshlm export --checkpoint=D --out=P`: params only, in the model's compute dtype unless `dtype` is given."""
    with open_source(checkpoint, step) as source:
        return write_params(source, out, dtype or source.compute_dtype, flag="--out")


def save_params(
    params: Any, cfg: ModelConfig, out: str | Path, dtype: str | None = None, tokenizer_dir: str | Path | None = None
) -> Path:
    """Write in-memory parameters (single process) as a meshlm params folder."""
    return write_params(ArraySource(params, cfg, tokenizer_dir), out, dtype)


__all__ = ["convert_from_hf", "convert_to_hf", "export_params", "save_params"]
