"""A LoRA run's checkpoint read as a weight source: its frozen base with the adapters merged in.

The checkpoint holds the adapters (params/lora) and optimizer state, not the base; its metadata's "lora"
entry says the rank, alpha, targets and which base (the `--init_from` folder, or the seed of a random
one). `LoraCheckpoint` reads like any `Source`: `block`/`slice` merge on the host one layer at a time
(what `meshlm export --merge` writes), `load` merges on the mesh (what serving places), both by
`meshlm.models.lora.merged_weight` in float32 as training does. `lora_meta` tells such a checkpoint apart.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.checkpoint.folders import TOKENIZER_DIR, carried_files
from meshlm.checkpoint.hf_map import Leaf, get_path, leaves
from meshlm.checkpoint.safetensors_io import np_dtype
from meshlm.checkpoint.source import ArraySource, Source
from meshlm.checkpoint.train_checkpoint import (
    config_from_meta,
    find_checkpoint,
    is_train_checkpoint,
    policy_from_meta,
    read_meta,
)
from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig
from meshlm.models.lora import DEFAULT_TARGETS, LoraSpec, merge_tree, merged_weight, place_lora
from meshlm.strategy.rules import flatten, unflatten


def lora_meta(path: Path, step: int | None = None) -> dict | None:
    """The whole metadata of a training checkpoint whose run trained LoRA adapters, else None (not a
    training checkpoint, one that trained every weight, or metadata the whole-weight reader reports on)."""
    if not is_train_checkpoint(path):
        return None
    directory, step, _ = find_checkpoint(path, step)
    try:
        meta = read_meta(directory, step)
    except Exception:  # noqa: BLE001  (unreadable metadata: TrainCheckpoint says so, in one line)
        return None
    return meta if meta.get("lora") and "model" in meta else None


def lora_spec(lora: dict) -> LoraSpec:
    """The run's LoraSpec from its checkpoint's "lora" entry."""
    return LoraSpec(
        int(lora["rank"]),
        float(lora["alpha"]),
        lora.get("targets") or DEFAULT_TARGETS,
        lora.get("base_dtype") or "float32",
    )


def read_adapters(checkpoint: str | Path, step: int | None = None) -> tuple[ModelConfig, dict, dict]:
    """(model config, the run's "lora" metadata, the adapters as one-stack numpy trees) of a LoRA checkpoint."""
    import orbax.checkpoint as ocp  # jax with it: only once a checkpoint is read

    from meshlm.checkpoint.manager import reads_that_may_fail

    directory, step, _ = find_checkpoint(checkpoint, step)
    where = directory / str(step)
    meta = read_meta(directory, step)
    if not meta.get("lora"):
        raise UsageError(
            f"checkpoint {where} holds no LoRA adapters (it trained every weight); export it without "
            "--lora_format and --merge"
        )
    state_dir = where / "state"
    with reads_that_may_fail():
        tree = ocp.PyTreeCheckpointHandler().metadata(state_dir)
        stored = getattr(tree, "tree", tree)["params"]["lora"]
        item = _map(stored, lambda _: 0)
        args = _map(stored, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
        restore = ocp.args.PyTreeRestore(
            item={"params": {"lora": item}}, restore_args={"params": {"lora": args}}, partial_restore=True
        )
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
        return (
            np.concatenate(parts)
            if not isinstance(parts[0], dict)
            else {k: join(*(p[k] for p in parts)) for k in parts[0]}
        )

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
        if (
            len(leaf.groups) != 2
            or list(in_axes) != list(range(len(in_axes)))
            or list(out_axes) != list(range(len(in_axes), len(leaf.shape)))
        ):
            raise UsageError(f"{leaf.name} has adapters but is no projection that PEFT can adapt")
        out.append((leaf, np.asarray(node["a"]), np.asarray(node["b"])))
    return out


def open_base(cfg: ModelConfig, lora: dict, base: str | Path | None = None) -> Source:
    """The base the adapters sit on: `base` if given, else the folder the checkpoint records, else the
    random weights of the recorded seed (rebuilt here)."""
    from meshlm.checkpoint.weights import check_compatible, open_source  # weights opens this reader too

    path = base if base is not None else lora.get("base")
    if path is not None:
        if not Path(path).expanduser().exists():
            raise UsageError(
                f"the base model {path} is not there; pass --base=DIR, the folder the adapters were trained on"
            )
        source = open_source(path)
        check_compatible(source.cfg, cfg, source.where)
        return source
    import jax  # only a random base is built here, on one device

    from meshlm.mesh import MeshShape, build_mesh
    from meshlm.models.placement import place
    from meshlm.models.policy import RunPolicy

    mesh = build_mesh(MeshShape(1, 1, 1, 1), jax.devices()[:1])
    placement = place(cfg, mesh, policy=RunPolicy(param_dtype="float32"))
    params = jax.device_get(jax.jit(placement.random_params, static_argnums=0)(int(lora.get("base_seed", 0))))
    dt = np_dtype(lora.get("base_dtype", "float32"))
    return ArraySource(jax.tree.map(lambda a: np.asarray(a).astype(dt), params), cfg)


class LoraCheckpoint(Source):
    """One step of a LoRA run's checkpoint: the base (`base` replaces the folder the run recorded) with
    W + (alpha / r)·A·B in each adapted weight. `carried` are the base's files; `run_files` the run's own
    tokenizer files (serving prefers them when they hold a tokenizer.json)."""

    def __init__(self, path: str | Path, step: int | None = None, base: str | Path | None = None):
        self.cfg, self.recorded, self.adapters = read_adapters(path, step)
        self.path, self.spec = str(path), lora_spec(self.recorded)
        self.base = open_base(self.cfg, self.recorded, base)
        self.where, self.carried = self.base.where, self.base.carried
        directory, found, run_dir = find_checkpoint(path, step)
        self.compute_dtype = policy_from_meta(read_meta(directory, found)).dtype
        self.run_files = carried_files(run_dir / TOKENIZER_DIR) if run_dir is not None else ()
        self.adapted = {leaf.name: (a, b) for leaf, a, b in adapted_leaves(self.cfg, self.adapters)}

    def dtype(self, leaf: Leaf) -> np.dtype:
        return self.base.dtype(leaf)

    def block(self, leaf: Leaf, layer: int | None) -> np.ndarray:
        w = self.base.block(leaf, layer)
        if leaf.name not in self.adapted:
            return w
        a, b = self.adapted[leaf.name]
        a, b = (a, b) if layer is None else (a[layer], b[layer])
        f32 = np.float32
        return merged_weight(np.asarray(w, f32), a.astype(f32), b.astype(f32), self.spec.scale).astype(w.dtype)

    def slice(self, leaf: Leaf, index: tuple[slice, ...]) -> np.ndarray:
        whole = np.stack([self.block(leaf, i) for i in leaf.blocks()]) if leaf.layers else self.block(leaf, None)
        return whole[tuple(index)]

    def load(self, placement) -> Any:
        """The base placed on `placement`'s mesh in the dtype the run trained it in, the adapters on their
        own layouts, merged there and cast to `placement`'s param dtype and layout."""
        import jax  # as Source.load: jax only once parameters are placed
        import jax.numpy as jnp

        from meshlm.models.placement import place

        model, mesh, strategy, policy = placement.cfg, placement.mesh, placement.strategy, placement.policy
        f32 = place(model, mesh, strategy, policy=policy.replace(param_dtype="float32"))
        held = (
            f32
            if self.spec.base_dtype == "float32"
            else place(model, mesh, strategy, policy=policy.replace(param_dtype=self.spec.base_dtype))
        )
        lora = place_lora(f32, self.spec)
        params = self.base.load(held)  # the base as the run trained on it: in its base dtype
        adapters = _put_adapters(self.adapters, lora, self.path)
        dt = jnp.dtype(policy.param_dtype)

        def merge(b, a):
            return jax.tree.map(lambda w: w.astype(dt), merge_tree(b, a, self.spec.scale))

        same = jnp.dtype(self.spec.base_dtype) == dt  # the base's buffers can hold the merged weights
        return jax.jit(merge, out_shardings=placement.shardings, donate_argnums=(0,) if same else ())(params, adapters)

    def close(self) -> None:
        self.base.close()


def _put_adapters(adapters: dict, lora: Any, where: str) -> Any:
    """The run's adapters (one-stack numpy trees) as global arrays on the adapters' shardings; each
    device takes only its slice (so this works across processes too)."""
    import jax

    have, shapes, shardings = flatten(adapters), flatten(lora.shapes), flatten(lora.shardings)
    if set(have) != set(shapes):
        missing = sorted(set(have) ^ set(shapes))[:3]
        raise UsageError(
            f"the adapters in {where} do not match the targets their run recorded ({', '.join(missing)}); "
            "serve a `meshlm export --merge` folder instead"
        )
    out = {}
    for path, target in shapes.items():
        value = np.asarray(have[path])
        if tuple(value.shape) != tuple(target.shape):
            raise UsageError(f"{where}: adapter {path} has shape {value.shape}, expected {tuple(target.shape)}")
        out[path] = jax.make_array_from_callback(target.shape, shardings[path], _indexer(value.astype(target.dtype)))
    return unflatten(out)


def _indexer(value: np.ndarray):
    """The callback that gives a device its block of `value`."""

    def block(index):
        return value[index]

    return block


__all__ = ["LoraCheckpoint", "lora_meta", "lora_spec", "read_adapters", "adapted_leaves", "open_base"]
