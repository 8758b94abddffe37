"""The meshlm params folder: a model's parameters alone, in meshlm's own layout, ready to place on any mesh.

    P/config.json          Hugging Face style (so `--model=P` reads it too), torch_dtype = the weights' dtype
    P/params.safetensors   meshlm's tree, one tensor per leaf, stacked layers included ("layers.mlp.up" [L, E, M])
    P/tokenizer/           the tokenizer files, when known; P/generation_config.json likewise

`meshlm convert --from_hf` and `meshlm export` write it (`write_params`, from any `Source`); `ParamsSource`
reads it. Layer i of a stacked leaf is one contiguous block of the file, so the writer streams layer by
layer and never assembles a stacked leaf in memory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from meshlm.checkpoint.folders import CONFIG_FILE, TOKENIZER_DIR, Staging, carried_files, check_out, copy_carried
from meshlm.checkpoint.hf_map import Leaf, leaves
from meshlm.checkpoint.safetensors_io import SafetensorsWriter, SliceReader, np_dtype, read_header
from meshlm.checkpoint.source import Source
from meshlm.errors import UsageError
from meshlm.models.hf_config import read_hf_config, to_hf_config

PARAMS_FILE = "params.safetensors"


def is_params_folder(path: Path) -> bool:
    return (path / PARAMS_FILE).is_file()


class ParamsSource(Source):
    """A meshlm params folder: config.json + params.safetensors in meshlm's own layout."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.where = str(d)
        if not (d / CONFIG_FILE).is_file():
            raise UsageError(f"{d} has {PARAMS_FILE} but no config.json; re-run meshlm convert or export")
        self.cfg = read_hf_config(d / CONFIG_FILE)
        self.entries = read_header(d / PARAMS_FILE)
        for leaf in leaves(self.cfg):
            entry = self.entries.get(leaf.name)
            if entry is None or entry.shape != leaf.full_shape:
                got = "is missing" if entry is None else f"has shape {entry.shape}"
                raise UsageError(f"{d / PARAMS_FILE}: {leaf.name} {got}, but config.json implies {leaf.full_shape}")
        self.carried = carried_files(d / TOKENIZER_DIR, d)
        self._slices = SliceReader()

    def dtype(self, leaf: Leaf) -> np.dtype:
        return self.entries[leaf.name].dtype

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        entry = self.entries[leaf.name]
        if leaf.layers:
            assert layer is not None, f"{leaf.name} is stacked over layers: read it one layer at a time"
            return entry.read_rows(layer, layer + 1)[0]
        return entry.read_rows()

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        return self._slices.slice(self.entries[leaf.name], tuple(index))

    def release(self) -> None:
        self._slices.close()


def write_params(source: Source, out: str | Path, dtype: str | None = None, flag: str = "--out") -> Path:
    """Write a meshlm params folder (config.json, params.safetensors, tokenizer/) from any source, streaming."""
    out = Path(out).expanduser()
    check_out(out, flag)
    all_leaves = leaves(source.cfg)
    dtypes = {leaf.name: np_dtype(dtype) if dtype else source.dtype(leaf) for leaf in all_leaves}
    with Staging(out) as tmp:
        specs = [(leaf.name, dtypes[leaf.name], leaf.full_shape) for leaf in all_leaves]
        writer = SafetensorsWriter(tmp / PARAMS_FILE, specs, {"format": "meshlm"})
        try:
            for leaf in all_leaves:
                size = math.prod(leaf.shape)
                for i in leaf.blocks():
                    writer.write(leaf.name, source.block(leaf, i), start=(i or 0) * size)
        finally:
            writer.close()
        config = to_hf_config(source.cfg, np.dtype(dtypes["embed"]).name)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        copy_carried(source.carried, tmp / TOKENIZER_DIR, tmp)
    return out


__all__ = ["PARAMS_FILE", "ParamsSource", "write_params", "is_params_folder"]
