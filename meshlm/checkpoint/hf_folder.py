"""A Hugging Face *ForCausalLM folder, read (`HFSource`) and written (`write_hf`) one tensor at a time.

The folder: config.json + model.safetensors, or model-0000k-of-0000n.safetensors with
model.safetensors.index.json; one tensor per layer ("model.layers.3.mlp.up_proj.weight" [M, E]), in the
layouts `hf_map` describes; tokenizer files and generation_config.json beside them. A Gemma 3 folder with
images (Gemma3ForConditionalGeneration) is read for its text model, whose tensors sit under another prefix.

Reading a whole tensor goes through `Entry.read_rows` (no memory map) and reshapes it as a view; reading a
device's slice slices the Hugging Face tensor on the outermost meshlm dimension of each of its dimensions and
the rest in memory. Writing fixes every file's header from config.json first, then streams each tensor to
its final offset, so host memory holds one tensor (plus one cast chunk) at a time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from meshlm.checkpoint.folders import CONFIG_FILE, Staging, carried_files, check_out, copy_carried
from meshlm.checkpoint.hf_map import Leaf, hf_tensor_order, leaves
from meshlm.checkpoint.safetensors_io import (
    INDEX_FILE,
    Entry,
    SafetensorsWriter,
    SliceReader,
    index_json,
    np_dtype,
    read_header,
    read_index,
    shard_file_names,
)
from meshlm.checkpoint.source import Source, slice_bounds
from meshlm.errors import UsageError
from meshlm.models.hf_config import read_hf_config, to_hf_config

DEFAULT_SHARD_BYTES = 5 << 30
# Where a text model's "model." tensors sit in a multimodal checkpoint: transformers 5, then 4's files.
TEXT_MODEL_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


class HFSource(Source):
    """A Hugging Face *ForCausalLM folder: config.json and *.safetensors (sharded with an index, or not)."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.where = str(d)
        if not (d / CONFIG_FILE).is_file():
            raise UsageError(
                f"{d} has no config.json; point at a Hugging Face model folder (config.json, *.safetensors)"
            )
        self.cfg = read_hf_config(d / CONFIG_FILE)
        files = read_index(d)
        if files is None:
            files = sorted(d.glob("*.safetensors"))
        if not files:
            bins = "pytorch_model*.bin files are not supported: re-save with save_pretrained(safe_serialization=True)"
            raise UsageError(f"{d} has no *.safetensors files; {bins}")
        self.entries: dict[str, Entry] = {}
        for f in files:
            self.entries.update(read_header(f))
        prefix = next((p for p in TEXT_MODEL_PREFIXES if p + "embed_tokens.weight" in self.entries), "model.")
        self.names: dict[str, Entry] = {}  # hf_map's name -> the name in these files
        for leaf in leaves(self.cfg):
            for i in leaf.blocks():
                name = leaf.hf_name(i)
                entry = self.entries.get(prefix + name.removeprefix("model.") if name.startswith("model.") else name)
                if entry is None:
                    hint = " (config.json says tie_word_embeddings=false)" if leaf.path == ("lm_head",) else ""
                    raise UsageError(f"{d} has no tensor {name}{hint}; is it a {self.cfg.family} checkpoint?")
                if entry.shape != leaf.hf_shape:
                    raise UsageError(f"{d}: {name} has shape {entry.shape} but config.json implies {leaf.hf_shape}")
                self.names[name] = entry
        self.carried = carried_files(d)
        self._slices = SliceReader()

    def _entry(self, leaf: Leaf, layer: int | None) -> Entry:
        return self.names[leaf.hf_name(layer)]

    def dtype(self, leaf: Leaf) -> np.dtype:
        return self._entry(leaf, 0 if leaf.layers else None).dtype

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        return leaf.to_meshlm(self._entry(leaf, layer).read_rows())

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        bounds = slice_bounds(index, leaf.full_shape)
        if leaf.layers:
            (l0, l1), inner = bounds[0], bounds[1:]
            return np.stack([self._block_slice(leaf, i, inner) for i in range(l0, l1)])
        return self._block_slice(leaf, None, bounds)

    def _block_slice(self, leaf: Leaf, layer: int | None, bounds: list[tuple[int, int]]) -> np.ndarray:
        """Slice the Hugging Face tensor on the outermost meshlm dim of each of its dims, then the rest in memory."""
        hf_index, view_shape, post = [], [], []
        for g in leaf.groups:
            outer, inner = g[0], g[1:]
            size = math.prod(leaf.shape[d] for d in inner)
            start, stop = bounds[outer]
            hf_index.append(slice(start * size, stop * size))
            view_shape += [stop - start] + [leaf.shape[d] for d in inner]
            post += [slice(None)] + [slice(*bounds[d]) for d in inner]
        part = self._slices.slice(self._entry(leaf, layer), tuple(hf_index))
        return part.reshape(view_shape)[tuple(post)].transpose(np.argsort(leaf.order))

    def release(self) -> None:
        self._slices.close()


def write_hf(
    source: Source,
    hf_dir: str | Path,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    flag: str = "--to_hf",
) -> Path:
    """Write the family's Hugging Face *ForCausalLM folder (`AutoModelForCausalLM.from_pretrained` loads it)."""
    out = Path(hf_dir).expanduser()
    check_out(out, flag)
    all_leaves = leaves(source.cfg)
    dtypes = {leaf.name: np_dtype(dtype) if dtype else source.dtype(leaf) for leaf in all_leaves}
    tensors = hf_tensor_order(source.cfg)  # shards fill in this order
    shards: list[list[tuple[str, Leaf]]] = [[]]
    used = 0
    for name, leaf in tensors:
        nbytes = math.prod(leaf.shape) * dtypes[leaf.name].itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, leaf))
        used += nbytes
    file_names = shard_file_names(len(shards))
    with Staging(out) as tmp:
        writers, file_of = [], {}
        try:
            for fname, shard in zip(file_names, shards):
                specs = [(name, dtypes[leaf.name], leaf.hf_shape) for name, leaf in shard]
                writers.append(SafetensorsWriter(tmp / fname, specs, {"format": "pt"}))
                file_of.update({name: writers[-1] for name, _ in shard})
            for leaf in all_leaves:
                for i in leaf.blocks():
                    file_of[leaf.hf_name(i)].write(leaf.hf_name(i), leaf.to_hf(source.block(leaf, i)))
        finally:
            for w in writers:
                w.close()
        if len(shards) > 1:
            total = sum(math.prod(leaf.shape) * dtypes[leaf.name].itemsize for _, leaf in tensors)
            weight_map = {name: file_names[k] for k, shard in enumerate(shards) for name, _ in shard}
            (tmp / INDEX_FILE).write_text(index_json(weight_map, total))
        config = to_hf_config(source.cfg, np.dtype(dtypes["embed"]).name)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        copy_carried(source.carried, tmp, tmp)
    return out


__all__ = ["HFSource", "write_hf", "DEFAULT_SHARD_BYTES"]
