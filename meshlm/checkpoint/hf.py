"""Hugging Face LLaMA weights in and out, streamed one tensor at a time.

Three on-disk forms of a model's parameters, all read through one `Source` interface:

    Hugging Face folder   config.json + model.safetensors (or model-0000k-of-0000n.safetensors and
                          model.safetensors.index.json), LlamaForCausalLM names and layouts:
                          "model.layers.3.mlp.up_proj.weight" [M, E], one tensor per layer.
    meshlm params folder  config.json (Hugging Face style, so `--model=P` reads it too), params.safetensors
                          holding meshlm's own tree ("layers.mlp.up" [L, E, M]) and tokenizer/ when known.
                          `meshlm convert --from_hf` and `meshlm export` write this.
    training checkpoint   a `Checkpointer` folder (manager.py), read leaf by leaf: see export.py.

Layouts. Every meshlm leaf is a transpose of a reshape of the Hugging Face tensor (`Leaf.groups` says which
meshlm dimensions each Hugging Face dimension merges): q_proj [H*D, E] -> wq [E, H, D]; o_proj [E, H*D] ->
wo [H, D, E]; gate/up_proj [M, E] -> [E, M]; down_proj [E, M] -> [M, E]; lm_head [V, E] -> [E, V]. Both sides
apply RoPE to the two halves of each head ("rotate half"), so q and k need no permutation.

Streaming. The output safetensors file's header (names, shapes, dtypes, offsets) is known from config.json
before any weight is read, so it is written first and each tensor is then read whole from its source
(`readinto` on the file, no memory map), reshaped as a view, cast and written at its final offset in 16 MiB
row chunks. The stacked meshlm leaves [L, ...] are never assembled in memory: layer i of a leaf is a
contiguous block of the file. Peak host memory of `convert_from_hf` is therefore one Hugging Face tensor
(the largest one: usually embed_tokens or lm_head [V, E], or one layer's [M, E] MLP weight) plus one chunk
plus the interpreter: measured by tests/checkpoint/test_hf.py, a 320 MiB model whose largest tensor is 32 MiB
(and whose stacked MLP leaves are 64 MiB) peaks 49 MiB above the 35 MiB interpreter. (`safetensors.safe_open`
memory-maps the file: the mapped pages stay resident while it is open and count in the peak RSS, 1.9x a
tensor when opened per tensor, the whole file when opened once; so whole tensors are read with `readinto`.) `convert_to_hf` from a params folder streams the same way; from a
training checkpoint it restores one whole leaf at a time (the largest stacked leaf, e.g. [L, E, M]).

Loading (`load_params`) places each leaf straight into its `NamedSharding` with
`jax.make_array_from_callback`: each device's callback reads only its slice (`safe_open(...).get_slice`),
so the whole model is never gathered on one device or in one host buffer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig, from_hf_config, to_hf_config

PARAMS_FILE = "params.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
HF_INDEX = "model.safetensors.index.json"
# Files carried along: tokenizer files go to P/tokenizer/ (what `--tokenizer=P/tokenizer` reads), the
# generation config to P/; both go back beside config.json in a Hugging Face folder.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "added_tokens.json",
)
GENERATION_CONFIG = "generation_config.json"
CHUNK_BYTES = 16 << 20
DEFAULT_SHARD_BYTES = 5 << 30

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in _DTYPES.items()}
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def np_dtype(name: str | np.dtype, flag: str = "--dtype") -> np.dtype:
    """'bfloat16' -> numpy dtype (ml_dtypes for bfloat16); one-line error for anything but a float type."""
    if isinstance(name, np.dtype):
        return name
    if name not in FLOAT_DTYPES:
        raise UsageError(f"{flag}={name}: choose one of {', '.join(FLOAT_DTYPES)}")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# ------------------------------------------------------------------------------------- the mapping


@dataclass(frozen=True)
class Leaf:
    """One meshlm parameter and the Hugging Face tensor(s) it comes from (one per layer when stacked)."""

    path: tuple[str, ...]  # ("layers", "attn", "wq")
    hf: str  # Hugging Face name; "{i}" is the layer index
    shape: tuple[int, ...]  # one block: one layer of a stacked leaf, or the whole leaf
    groups: tuple[tuple[int, ...], ...]  # Hugging Face dim k merges these block dims, outermost first
    layers: int = 0  # > 0: stacked on a leading [L] axis

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (self.layers, *self.shape) if self.layers else self.shape

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d] for d in g) for g in self.groups)

    @property
    def _order(self) -> list[int]:
        return [d for g in self.groups for d in g]

    def blocks(self) -> Iterator[int | None]:
        """The layer indices of a stacked leaf, or a single None."""
        return iter(range(self.layers)) if self.layers else iter([None])

    def hf_name(self, layer: int | None) -> str:
        return self.hf.format(i=layer)

    def to_meshlm(self, hf: np.ndarray) -> np.ndarray:
        """A view of the Hugging Face tensor in meshlm's layout (no copy)."""
        order = self._order
        return hf.reshape([self.shape[d] for d in order]).transpose(np.argsort(order))

    def to_hf(self, block: np.ndarray) -> np.ndarray:
        return block.transpose(self._order).reshape(self.hf_shape)


def leaves(cfg: ModelConfig) -> list[Leaf]:
    """Every parameter of `meshlm.models.llama.Llama` built from cfg, in Hugging Face file order."""
    E, H, K, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    M, V, L = cfg.mlp_dim, cfg.vocab_size, cfg.n_layers
    layer = [
        (("attn_norm", "scale"), "input_layernorm.weight", (E,), ((0,),)),
        (("attn", "wq"), "self_attn.q_proj.weight", (E, H, D), ((1, 2), (0,))),
        (("attn", "wk"), "self_attn.k_proj.weight", (E, K, D), ((1, 2), (0,))),
        (("attn", "wv"), "self_attn.v_proj.weight", (E, K, D), ((1, 2), (0,))),
        (("attn", "wo"), "self_attn.o_proj.weight", (H, D, E), ((2,), (0, 1))),
        (("mlp_norm", "scale"), "post_attention_layernorm.weight", (E,), ((0,),)),
        (("mlp", "gate"), "mlp.gate_proj.weight", (E, M), ((1,), (0,))),
        (("mlp", "up"), "mlp.up_proj.weight", (E, M), ((1,), (0,))),
        (("mlp", "down"), "mlp.down_proj.weight", (M, E), ((1,), (0,))),
    ]
    out = [Leaf(("embed",), "model.embed_tokens.weight", (V, E), ((0,), (1,)))]
    out += [Leaf(("layers", *p), "model.layers.{i}." + n, s, g, L) for p, n, s, g in layer]
    out.append(Leaf(("final_norm", "scale"), "model.norm.weight", (E,), ((0,),)))
    if not cfg.tie_embeddings:
        out.append(Leaf(("lm_head",), "lm_head.weight", (E, V), ((1,), (0,))))
    return out


def config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig of a Hugging Face config.json dict; unsupported LLaMA variants are named."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UsageError(f"{where}: attention_bias/mlp_bias models are not supported (meshlm's LLaMA has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; LLaMA uses 'silu'")
    return from_hf_config(hf)


def hf_config_dict(cfg: ModelConfig, dtype: np.dtype | str | None) -> dict[str, Any]:
    out = to_hf_config(cfg)
    if dtype is not None:
        out["torch_dtype"] = out["dtype"] = np.dtype(dtype).name
    return out


# ------------------------------------------------------------------------------------ safetensors I/O


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in a safetensors file."""

    file: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data

    def read_rows(self, r0: int = 0, r1: int | None = None) -> np.ndarray:
        """Rows [r0, r1) of the leading axis, read with `readinto` into one fresh buffer (no memory map)."""
        r1 = self.shape[0] if r1 is None else r1
        row = math.prod(self.shape[1:])
        out = np.empty((r1 - r0) * row, self.dtype)
        view = memoryview(out.view(np.uint8))
        with open(self.file, "rb", buffering=0) as f:
            f.seek(self.start + r0 * row * self.dtype.itemsize)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise UsageError(f"{self.file} is truncated (tensor {self.name}); re-download or re-convert it")
                done += n
        return out.reshape((r1 - r0, *self.shape[1:]))


def read_header(path: Path) -> dict[str, Entry]:
    """Name -> Entry for every tensor of a safetensors file; a corrupt header is a UsageError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise UsageError(f"{path} is not a safetensors file (bad header); re-download or re-convert it")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"{path} has a corrupt safetensors header; re-download or re-convert it") from None
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        if h["dtype"] not in _DTYPES:
            raise UsageError(f"{path}: tensor {name} has dtype {h['dtype']}, which meshlm cannot read")
        dtype, shape = _DTYPES[h["dtype"]], tuple(h["shape"])
        begin, end = h["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
            raise UsageError(f"{path}: tensor {name} does not fit the file (truncated?); re-download or re-convert it")
        out[name] = Entry(path, name, dtype, shape, 8 + n + begin)
    return out


class SafetensorsWriter:
    """A safetensors file whose header is fixed up front; tensors (or row blocks of them) are then written
    in any order at their final offsets, cast to the declared dtype chunk by chunk."""

    def __init__(self, path: Path, specs: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": metadata}
        self.where: dict[str, tuple[int, np.dtype, int]] = {}
        offset = 0
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.where[name] = (offset, dtype, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.base = 8 + len(raw)
        self.path = path
        self.written = dict.fromkeys(self.where, 0)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pwrite(struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self.fd, self.base + offset)

    def _pwrite(self, data, pos: int) -> None:
        view = memoryview(data)
        while len(view):
            n = os.pwrite(self.fd, view, pos)
            view, pos = view[n:], pos + n

    def write(self, name: str, array: np.ndarray, start: int = 0) -> None:
        """Write `array` (any layout, any float dtype) as elements [start, start + size) of tensor `name`."""
        offset, dtype, _ = self.where[name]
        array = np.asarray(array)
        if array.ndim == 0:
            array = array.reshape(1)
        pos = self.base + offset + start * dtype.itemsize
        if array.dtype == dtype and array.flags.c_contiguous:  # already laid out: write it as it is
            self._pwrite(array.reshape(-1).view(np.uint8), pos)
            self.written[name] += array.nbytes
            return
        row_bytes = max(1, math.prod(array.shape[1:]) * dtype.itemsize)
        step = max(1, CHUNK_BYTES // row_bytes)
        for r in range(0, array.shape[0], step):
            chunk = array[r : r + step].astype(dtype, order="C").reshape(-1).view(np.uint8)
            self._pwrite(chunk, pos)
            pos += chunk.nbytes
            self.written[name] += chunk.nbytes
            del chunk  # free before the next chunk is allocated: one chunk alive at a time

    def close(self) -> None:
        os.close(self.fd)
        missing = [n for n, (_, _, nbytes) in self.where.items() if self.written[n] != nbytes]
        if missing:
            raise RuntimeError(f"{self.path}: tensors not fully written: {missing[:3]}")


# ------------------------------------------------------------------------------------------ sources


class Source:
    """Parameters on disk, read as meshlm leaves: a whole block (one layer) or a slice of a leaf."""

    cfg: ModelConfig
    where: str
    carried: tuple[Path, ...] = ()  # tokenizer files and generation_config.json to copy along

    def dtype(self, leaf: Leaf) -> np.dtype:
        raise NotImplementedError

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        """Layer `layer` of a stacked leaf (None: the whole unstacked leaf), in meshlm layout."""
        raise NotImplementedError

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        """leaf[index] in meshlm layout, reading little more than that slice."""
        raise NotImplementedError

    def load(self, placement) -> Any:
        """Every leaf placed into `placement.shardings`; each device's callback reads only its slice."""
        import jax

        shapes, shardings = placement.shapes, placement.shardings
        wanted = {_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]}
        have = {"/".join(leaf.path) for leaf in leaves(self.cfg)}
        if wanted != have:
            raise UsageError(f"{self.where}: parameters {sorted(have ^ wanted)[:3]} do not match this model's")
        params: dict[str, Any] = {}
        for leaf in leaves(self.cfg):
            target, sharding = _get(shapes, leaf.path), _get(shardings, leaf.path)
            if tuple(target.shape) != leaf.full_shape:
                raise UsageError(f"{self.where}: {leaf.name} is {leaf.full_shape} but this model needs {target.shape}")

            def read(index, leaf=leaf, dtype=target.dtype):
                return np.asarray(self.slice(leaf, index)).astype(dtype)

            _set(params, leaf.path, jax.make_array_from_callback(target.shape, sharding, read))
            self.release()
        return params

    def release(self) -> None:
        """Drop open file mappings (their resident pages would otherwise add up to the whole file)."""

    def close(self) -> None:
        self.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError("strided slices are not supported")
        out.append((start, stop))
    return out


class _SafeHandles:
    """Open `safe_open` handles, one per file, for slicing (they memory-map: closed with the source)."""

    def __init__(self):
        self._open: dict[Path, Any] = {}

    def slice(self, entry: Entry, index: tuple[slice, ...]) -> np.ndarray:
        from safetensors import safe_open

        if entry.file not in self._open:
            self._open[entry.file] = safe_open(str(entry.file), framework="numpy")
        return self._open[entry.file].get_slice(entry.name)[index]

    def close(self) -> None:
        self._open.clear()


class HFSource(Source):
    """A Hugging Face LlamaForCausalLM folder: config.json and *.safetensors (sharded with an index, or not)."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.where = str(d)
        if not (d / CONFIG_FILE).is_file():
            raise UsageError(f"{d} has no config.json; point at a Hugging Face model folder (config.json, *.safetensors)")
        try:
            self.hf_config = json.loads((d / CONFIG_FILE).read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"{d / CONFIG_FILE} is not valid JSON ({e.msg} at line {e.lineno})") from None
        self.cfg = config_from_hf(self.hf_config, str(d / CONFIG_FILE))
        if (d / HF_INDEX).is_file():
            weight_map = json.loads((d / HF_INDEX).read_text()).get("weight_map", {})
            files = sorted({d / f for f in weight_map.values()})
            if missing := [f.name for f in files if not f.is_file()]:
                raise UsageError(f"{d / HF_INDEX} lists {missing[0]}, which is missing; download every shard")
        else:
            files = sorted(d.glob("*.safetensors"))
        if not files:
            bins = "pytorch_model*.bin files are not supported: re-save with save_pretrained(safe_serialization=True)"
            raise UsageError(f"{d} has no *.safetensors files; {bins}")
        self.entries: dict[str, Entry] = {}
        for f in files:
            self.entries.update(read_header(f))
        for leaf in leaves(self.cfg):
            for i in leaf.blocks():
                entry = self.entries.get(leaf.hf_name(i))
                if entry is None:
                    hint = " (config.json says tie_word_embeddings=false)" if leaf.path == ("lm_head",) else ""
                    raise UsageError(f"{d} has no tensor {leaf.hf_name(i)}{hint}; is it a LlamaForCausalLM checkpoint?")
                if entry.shape != leaf.hf_shape:
                    raise UsageError(
                        f"{d}: {leaf.hf_name(i)} has shape {entry.shape} but config.json implies {leaf.hf_shape}"
                    )
        self.carried = carried_files(d)
        self._handles = _SafeHandles()

    def _entry(self, leaf: Leaf, layer: int | None) -> Entry:
        return self.entries[leaf.hf_name(layer)]

    def dtype(self, leaf: Leaf) -> np.dtype:
        return self._entry(leaf, 0 if leaf.layers else None).dtype

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        return leaf.to_meshlm(self._entry(leaf, layer).read_rows())

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        bounds = _bounds(index, leaf.full_shape)
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
        part = self._handles.slice(self._entry(leaf, layer), tuple(hf_index))
        return part.reshape(view_shape)[tuple(post)].transpose(np.argsort(leaf._order))

    def release(self) -> None:
        self._handles.close()


class ParamsSource(Source):
    """A meshlm params folder: config.json + params.safetensors in meshlm's own layout."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        self.where = str(d)
        try:
            hf = json.loads((d / CONFIG_FILE).read_text())
        except FileNotFoundError:
            raise UsageError(f"{d} has {PARAMS_FILE} but no config.json; re-run meshlm convert or export") from None
        self.cfg = config_from_hf(hf, str(d / CONFIG_FILE))
        self.entries = read_header(d / PARAMS_FILE)
        for leaf in leaves(self.cfg):
            entry = self.entries.get(leaf.name)
            if entry is None or entry.shape != leaf.full_shape:
                got = "is missing" if entry is None else f"has shape {entry.shape}"
                raise UsageError(f"{d / PARAMS_FILE}: {leaf.name} {got}, but config.json implies {leaf.full_shape}")
        self.carried = carried_files(d / TOKENIZER_DIR, d)
        self._handles = _SafeHandles()

    def dtype(self, leaf: Leaf) -> np.dtype:
        return self.entries[leaf.name].dtype

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        entry = self.entries[leaf.name]
        return entry.read_rows(layer, layer + 1)[0] if leaf.layers else entry.read_rows()

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        return self._handles.slice(self.entries[leaf.name], tuple(index))

    def release(self) -> None:
        self._handles.close()


def open_source(path: str | Path, step: int | None = None) -> Source:
    """The right reader for a params folder, a training run/checkpoint folder or a Hugging Face folder."""
    from meshlm.checkpoint import export

    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{p} does not exist")
    if (p / PARAMS_FILE).is_file():
        return ParamsSource(p)
    if export.is_train_checkpoint(p):
        return export.TrainCheckpoint(p, step)
    if p.is_dir() and (p / CONFIG_FILE).is_file():
        return HFSource(p)
    raise UsageError(
        f"{p} is none of: a Hugging Face model folder (config.json + *.safetensors), a folder written by "
        "meshlm convert/export (params.safetensors), or a training run's output_dir / checkpoint folder"
    )


# -------------------------------------------------------------------------------------------- write


def check_out(out: Path, flag: str) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{flag}={out} already exists and is not empty; choose a new path or delete it")


class _Staging:
    """Write into a hidden sibling folder, rename onto `out` when complete: no half-written output."""

    def __init__(self, out: Path):
        self.out = out
        self.tmp = out.parent / f".{out.name}.partial-{os.getpid()}"

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            if self.out.exists():
                self.out.rmdir()  # check_out made sure it is empty
            os.replace(self.tmp, self.out)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def carried_files(*folders: Path | None) -> tuple[Path, ...]:
    """The tokenizer files and generation config in these folders (the first one found of each name)."""
    found: dict[str, Path] = {}
    for folder in folders:
        for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
            if folder is not None and name not in found and (folder / name).is_file():
                found[name] = folder / name
    return tuple(found.values())


def _copy_carried(files: tuple[Path, ...], tokenizer_dst: Path, other_dst: Path) -> None:
    for f in files:
        dst = tokenizer_dst if f.name in TOKENIZER_FILES else other_dst
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst / f.name)


def write_params(source: Source, out: str | Path, dtype: str | None = None, flag: str = "--out") -> Path:
    """Write a meshlm params folder (config.json, params.safetensors, tokenizer/) from any source, streaming."""
    out = Path(out).expanduser()
    check_out(out, flag)
    all_leaves = leaves(source.cfg)
    dtypes = {leaf.name: np_dtype(dtype) if dtype else source.dtype(leaf) for leaf in all_leaves}
    with _Staging(out) as tmp:
        specs = [(leaf.name, dtypes[leaf.name], leaf.full_shape) for leaf in all_leaves]
        writer = SafetensorsWriter(tmp / PARAMS_FILE, specs, {"format": "meshlm"})
        try:
            for leaf in all_leaves:
                size = math.prod(leaf.shape)
                for i in leaf.blocks():
                    writer.write(leaf.name, source.block(leaf, i), start=(i or 0) * size)
        finally:
            writer.close()
        config = hf_config_dict(source.cfg, dtypes["embed"])
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        _copy_carried(source.carried, tmp / TOKENIZER_DIR, tmp)
    return out


def write_hf(
    source: Source, hf_dir: str | Path, dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    flag: str = "--to_hf",
) -> Path:
    """Write a Hugging Face LlamaForCausalLM folder that `transformers.AutoModelForCausalLM.from_pretrained` loads."""
    out = Path(hf_dir).expanduser()
    check_out(out, flag)
    all_leaves = leaves(source.cfg)
    dtypes = {leaf.name: np_dtype(dtype) if dtype else source.dtype(leaf) for leaf in all_leaves}
    # Hugging Face order: embeddings, layer 0's tensors, layer 1's, ..., final norm, head; shards fill in that order.
    tensors = [(leaf.hf_name(None), leaf) for leaf in all_leaves if not leaf.layers and leaf.path == ("embed",)]
    for i in range(source.cfg.n_layers):
        tensors += [(leaf.hf_name(i), leaf) for leaf in all_leaves if leaf.layers]
    tensors += [(leaf.hf_name(None), leaf) for leaf in all_leaves if not leaf.layers and leaf.path != ("embed",)]
    shards: list[list[tuple[str, Leaf]]] = [[]]
    used = 0
    for name, leaf in tensors:
        nbytes = math.prod(leaf.shape) * dtypes[leaf.name].itemsize
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, leaf))
        used += nbytes
    n = len(shards)
    file_names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    with _Staging(out) as tmp:
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
        if n > 1:
            total = sum(math.prod(leaf.shape) * dtypes[leaf.name].itemsize for _, leaf in tensors)
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: file_names[k] for k, shard in enumerate(shards) for name, _ in shard}}
            (tmp / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config_dict(source.cfg, dtypes["embed"])
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        _copy_carried(source.carried, tmp, tmp)
    return out


# ---------------------------------------------------------------------------------- the CLI's calls


def convert_from_hf(hf_dir: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """`meshlm convert --from_hf=DIR --out=P`: a meshlm params folder at P (dtype: keep the file's by default)."""
    hf_dir = Path(hf_dir).expanduser()
    if not hf_dir.is_dir():
        raise UsageError(f"--from_hf={hf_dir}: no such folder; point at a Hugging Face model folder")
    with HFSource(hf_dir) as source:
        return write_params(source, out, dtype, flag="--out")


def convert_to_hf(
    checkpoint: str | Path, hf_dir: str | Path, dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    step: int | None = None,
) -> Path:
    """`meshlm convert --to_hf=DIR --checkpoint=P`: P is a params folder, a training run or checkpoint folder."""
    with open_source(checkpoint, step) as source:
        return write_hf(source, hf_dir, dtype, max_shard_bytes)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model shape stored with any source (for `--init_from`: build the model from this, then override)."""
    with open_source(_strip_hf(path)) as source:
        return source.cfg


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


def check_compatible(stored: ModelConfig, wanted: ModelConfig, where: str) -> None:
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "tie_embeddings"):
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


# ------------------------------------------------------------------------------------------ helpers


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


__all__ = [
    "Leaf", "leaves", "Source", "HFSource", "ParamsSource", "open_source", "SafetensorsWriter", "read_header",
    "write_params", "write_hf", "convert_from_hf", "convert_to_hf", "read_model_config", "parse_init_from",
    "load_params",
]
