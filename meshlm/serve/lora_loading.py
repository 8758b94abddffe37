"""A LoRA run's checkpoint served: its frozen base and its adapters merged on the mesh at load time.

A LoRA checkpoint holds the adapters, not the base (docs/lora.md); its metadata's "lora" entry names
the base (a folder, or the seed of a random one). `lora_meta` tells such a checkpoint apart;
`merged_params` reads the base onto the serving mesh in the dtype the run trained it in, the adapters
onto their own layouts, and returns W + (alpha / r)·A·B in every adapted weight (float32 arithmetic,
as in training), in the serving dtype and layout:

    meta = lora_meta(path, step)                     # None: not a LoRA checkpoint
    params, carried = merged_params(job, path, step, meta, base=None)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.errors import UsageError


def lora_meta(path: Path, step: int | None = None) -> dict | None:
    """The whole metadata of a training checkpoint whose run trained LoRA adapters, else None (not a
    training checkpoint, one that trained every weight, or metadata the whole-weight reader reports on)."""
    from meshlm.checkpoint.train_checkpoint import find_checkpoint, is_train_checkpoint

    if not is_train_checkpoint(path):
        return None
    from meshlm.checkpoint.manager import Checkpointer, reads_that_may_fail

    directory, step, _ = find_checkpoint(path, step)
    ckpt = Checkpointer(directory, async_save=False, read_only=True)
    try:
        with reads_that_may_fail():
            meta = ckpt.meta(step)
    except Exception:  # noqa: BLE001  (unreadable metadata: TrainCheckpoint says so, in one line)
        return None
    finally:
        ckpt.close()
    return meta if meta.get("lora") and "model" in meta else None


def lora_spec(lora: dict):
    """The run's LoraSpec from its checkpoint's "lora" entry."""
    from meshlm.models.lora import DEFAULT_TARGETS, LoraSpec

    return LoraSpec(int(lora["rank"]), float(lora["alpha"]), lora.get("targets") or DEFAULT_TARGETS,
                    lora.get("base_dtype") or "float32")


def _put_adapters(adapters: dict, lora: Any, where: str) -> Any:
    """The run's adapters (one-stack numpy trees) as global arrays on the adapters' shardings; each
    device takes only its slice (so this works across processes too)."""
    import jax
    import numpy as np

    from meshlm.strategy.rules import flatten, unflatten

    have, shapes, shardings = flatten(adapters), flatten(lora.shapes), flatten(lora.shardings)
    if set(have) != set(shapes):
        missing = sorted(set(have) ^ set(shapes))[:3]
        raise UsageError(f"the adapters in {where} do not match the targets their run recorded ({', '.join(missing)}); "
                         "serve a `meshlm export --merge` folder instead")
    out = {}
    for path, target in shapes.items():
        value = np.asarray(have[path])
        if tuple(value.shape) != tuple(target.shape):
            raise UsageError(f"{where}: adapter {path} has shape {value.shape}, expected {tuple(target.shape)}")
        value = value.astype(target.dtype)
        out[path] = jax.make_array_from_callback(target.shape, shardings[path], lambda index, v=value: v[index])
    return unflatten(out)


def merged_params(job: Any, path: Path, step: int | None, meta: dict, base: str | Path | None = None):
    """(the merged parameters on `job.placement`, the tokenizer files to serve with). `base` replaces the
    base folder the run recorded (`--base=DIR`, when it has moved). The tokenizer is the run's, else the
    base's."""
    import jax
    import jax.numpy as jnp

    from meshlm.checkpoint.folders import TOKENIZER_DIR, carried_files
    from meshlm.checkpoint.lora_export import open_base, read_adapters
    from meshlm.checkpoint.train_checkpoint import find_checkpoint
    from meshlm.models.lora import place_lora
    from meshlm.models.placement import place

    spec = lora_spec(meta["lora"])
    model = job.model
    f32 = place(model.replace(param_dtype="float32"), job.mesh, job.strategy)
    held = f32 if spec.base_dtype == "float32" else place(model.replace(param_dtype=spec.base_dtype), job.mesh,
                                                          job.strategy)
    lora = place_lora(f32, spec)
    cfg, recorded, adapters = read_adapters(path, step)
    with open_base(cfg, recorded, base) as source:
        params = source.load(held)  # the base as the run trained on it: in its base dtype
        carried = source.carried
    _, _, run_dir = find_checkpoint(path, step)
    own = carried_files(run_dir / TOKENIZER_DIR) if run_dir is not None else ()
    adapters = _put_adapters(adapters, lora, str(path))
    dt = jnp.dtype(model.param_dtype)

    def merge(b, a):
        return jax.tree.map(lambda w: w.astype(dt), lora.merge(b, a))

    same = jnp.dtype(spec.base_dtype) == dt  # the base's buffers can hold the merged weights
    merged = jax.jit(merge, out_shardings=job.placement.shardings, donate_argnums=(0,) if same else ())(params, adapters)
    return merged, (own if any(f.name == "tokenizer.json" for f in own) else carried)


__all__ = ["lora_meta", "lora_spec", "merged_params"]
