"""What a strategy does to the train step, read from the compiler (`meshlm explain`).

    meshlm explain --devices=8 --mesh_dim=2,1,4,1 --strategy=fsdp_tp --zero_stage=2 --tensor=layers/mlp/gate --png=out.png

Takes every `meshlm train` flag (swap the verb to explain a training command) and prints:
  1. every parameter: path, shape, PartitionSpec (and its gradient's and optimizer state's when they
     differ), bytes per device, and the table or rule that produced it;
  2. per-device memory of parameters, gradients and optimizer state, compiled, beside the ZeRO formula;
  3. every collective XLA put in the compiled train step: kind, mesh axes, bytes, where it comes from;
  4. with per-layer-range strategies, what each boundary costs: the residual stream's resharding;
  5. how one tensor (`--tensor`) lies across the devices, as text and optionally as a PNG;
  6. with `--pp`, the pipeline: stage layout, per-stage memory and stash, schedule and bubble, stage
     transfers (`meshlm.explain.pipeline`).
Nothing is trained; the step is compiled with abstract inputs, nothing allocated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm import axes, hlo
from meshlm.errors import UsageError, closest
from meshlm.models.placement import Placement
from meshlm.strategy.rules import flatten
from meshlm.strategy.zero import formula_bytes

# ------------------------------------------------------------------------------------ parameters


def _local_bytes(shape, dtype, spec: P, mesh) -> int:
    return math.prod(NamedSharding(mesh, spec).shard_shape(tuple(shape))) * np.dtype(dtype).itemsize


def param_rows(placement: Placement) -> list[dict]:
    """One row per parameter: path, shape, specs, bytes per device (of the parameter) and its source."""
    shapes = flatten(placement.shapes)
    specs = flatten(placement.specs)
    grads = flatten(placement.gradient_specs)
    opts = flatten(placement.opt_specs if placement.opt_specs is not None else placement.specs)
    sources = placement.sources or {}
    return [
        dict(
            path=p,
            shape=tuple(s.shape),
            dtype=str(s.dtype),
            spec=specs[p],
            grad_spec=grads[p],
            opt_spec=opts[p],
            bytes=_local_bytes(s.shape, s.dtype, specs[p], placement.mesh),
            source=sources.get(p, ""),
        )
        for p, s in shapes.items()
    ]


# -------------------------------------------------------------------------------- memory (compiled)


def n_params(placement: Placement, axis: str | None = None) -> int:
    """Parameters per device group: all of them, or with `axis` those one rank of that axis holds (the
    layers of one pipeline stage and the tables replicated over pp)."""
    specs = flatten(placement.specs)
    size = placement.mesh.shape.get(axis, 1) if axis else 1

    def over(spec) -> bool:
        return any(axis in (e if isinstance(e, tuple) else (e,)) for e in spec)

    return sum(
        math.prod(s.shape) // (size if axis and over(specs[p]) else 1) for p, s in flatten(placement.shapes).items()
    )


def data_size(placement: Placement) -> int:
    return math.prod(placement.mesh.shape[a] for a in placement.strategy.data_axes(placement.mesh))


def grad_bytes(placement: Placement) -> int:
    """Per-device bytes of the gradients in their layout (what the step hands to the optimizer)."""
    shapes = flatten(placement.shapes)
    specs = flatten(placement.gradient_specs)
    return sum(_local_bytes(s.shape, s.dtype, specs[p], placement.mesh) for p, s in shapes.items())


def state_memory(placement: Placement, compiled_step, compiled_grads, batch: dict) -> dict:
    """Per-device bytes: parameters + optimizer state (the compiled step's arguments less the batch),
    gradients (the compiled gradient function's outputs; without one, their layouts), and the ZeRO
    formula for the same stage. With a pp axis Ψ is one stage's parameters."""
    batch_bytes = sum(_local_bytes(b.shape, b.dtype, b.sharding.spec, placement.mesh) for b in batch.values())
    state = compiled_step.memory_analysis().argument_size_in_bytes - batch_bytes
    grads = (
        compiled_grads.memory_analysis().output_size_in_bytes if compiled_grads is not None else grad_bytes(placement)
    )
    pp = "pp" if placement.mesh.shape.get("pp", 1) > 1 else None
    out: dict[str, Any] = {
        "params+opt_state": int(state),
        "grads": int(grads),
        "total": int(state + grads),
        "grads_from": "compiled" if compiled_grads is not None else "layouts",
        "n_params": n_params(placement, pp),
        "data_devices": data_size(placement),
    }
    stage = placement.strategy.zero_stage
    if stage is not None:
        itemsize = np.dtype(jax.tree.leaves(placement.shapes)[0].dtype).itemsize
        f = formula_bytes(stage, out["n_params"], out["data_devices"], itemsize)
        out["formula"] = {**f, "total": sum(f.values())}
    return out


# ------------------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class CollectiveRow:
    kind: str
    axes: tuple[str, ...]  # mesh axes the devices of one group differ in
    payload_bytes: int  # per execution (see meshlm.hlo)
    count: int  # executions per step
    where: str

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes * self.count


def collectives(text: str, placement: Placement) -> list[CollectiveRow]:
    """Every collective of a compiled program over more than one device, with its mesh axes and origin:
    the op name from the HLO metadata, or else the parameter whose shape the collective moves."""
    by_shape: dict[tuple, list[str]] = {}
    for path, s in flatten(placement.shapes).items():
        by_shape.setdefault(tuple(s.shape), []).append(path)
    rows = []
    for c in hlo.on_mesh(text, placement.mesh):
        params = sorted({p for s in c.result_shapes for p in by_shape.get(s, [])})
        where = _boundary_name(c.op_name, [g.key for g in placement.groups]) or (
            "parameter " + " | ".join(params) if params else ""
        )
        rows.append(CollectiveRow(c.kind, c.axes, c.payload_bytes, c.count, where))
    return rows


_LOOP_EDGE = re.compile(r"(transpose\()?jvp\(layers (\d+-\d+)\)\)?/while")


def _boundary_name(op_name: str, group_keys: list[str]) -> str:
    """`op_name`, except a collective on the edge of a layer range's loop that another range follows:
    the residual stream's layout change at their boundary. JAX 0.10 names it by the boundary's own
    scope (`jvp(boundary 0-0>1-1)/sharding_constraint`); JAX 0.12 folds the constraint into the loop
    and names the loop (`jvp(layers 0-0)/while`, in the backward `transpose(jvp(layers 0-0))/while`)."""
    m = _LOOP_EDGE.fullmatch(op_name or "")
    if not m or m[2] not in group_keys[:-1]:
        return op_name
    after = group_keys[group_keys.index(m[2]) + 1]
    scope = f"jvp(boundary {m[2]}>{after})/sharding_constraint"
    return f"transpose({scope})" if m[1] else scope


# --------------------------------------------------------------------------------------- boundaries


def boundaries(placement: Placement, batch_size: int, seq_len: int) -> list[dict]:
    """For each boundary between layer groups: the residual stream [B, T, E]'s layout on both sides and
    the collectives of moving it, forward (into the next group) and backward (its gradient, back)."""
    from meshlm import sharding

    out = []
    shape = (batch_size, seq_len, placement.cfg.d_model)
    x = jax.ShapeDtypeStruct(shape, jax.numpy.dtype(placement.policy.dtype))
    logical = axes.STREAM
    for a, b in zip(placement.groups, placement.groups[1:]):
        specs = [
            sharding.logical_to_spec(logical, g.strategy.activations, placement.mesh, g.strategy.shared) for g in (a, b)
        ]
        moves = {}
        for direction, (src, dst) in (("forward", specs), ("backward", specs[::-1])):
            move = jax.jit(
                lambda v: v,
                in_shardings=NamedSharding(placement.mesh, src),
                out_shardings=NamedSharding(placement.mesh, dst),
            )
            moves[direction] = collectives(move.lower(x).compile().as_text() or "", placement)
        out.append(
            dict(
                before=f"layers {a.key} ({a.strategy.name})",
                after=f"layers {b.key} ({b.strategy.name})",
                shape=shape,
                spec_before=specs[0],
                spec_after=specs[1],
                **moves,
            )
        )
    return out


# ------------------------------------------------------------------------------------------ picture


def _tensor(placement: Placement, path: str) -> tuple[tuple[int, ...], P]:
    shapes, specs = flatten(placement.shapes), flatten(placement.specs)
    if path not in shapes:
        close = closest(path, shapes)
        hint = f"did you mean --tensor={close}? " if close else ""
        raise UsageError(
            f"--tensor={path}: no such parameter; {hint}choose one of {', '.join(list(shapes)[:6])}, ... "
            "(the paths `meshlm explain` lists)"
        )
    return tuple(shapes[path].shape), specs[path]


def layout(placement: Placement, path: str) -> dict:
    """The tensor as a 2-D grid of blocks: the two dimensions shown (the sharded ones first), each block's
    index ranges and the devices holding it."""
    shape, spec = _tensor(placement, path)
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    sharded = [d for d, e in enumerate(entries) if e is not None]
    # The sharded dimensions, then the last ones (a stacked layers axis in front is the least telling).
    dims = (
        sorted((sharded + [d for d in reversed(range(len(shape))) if d not in sharded])[:2]) if len(shape) >= 2 else [0]
    )
    index_map: Mapping[Any, Any] = NamedSharding(placement.mesh, spec).devices_indices_map(shape)
    blocks: dict[tuple, list[int]] = {}
    for device, index in index_map.items():
        key = tuple(index[d].indices(shape[d])[:2] for d in dims)
        blocks.setdefault(key, []).append(device.id)
    rows = sorted({k[0] for k in blocks})
    cols = sorted({k[-1] for k in blocks}) if len(dims) == 2 else [None]
    return dict(path=path, shape=shape, spec=spec, dims=dims, rows=rows, cols=cols, blocks=blocks)


def picture(placement: Placement, path: str, cell: int = 14) -> str:
    """Text picture in the style of `jax.debug.visualize_array_sharding`: one box per block, naming the
    devices that hold it (several when it is replicated)."""
    g = layout(placement, path)
    label = lambda ids: ("dev " if len(ids) == 1 else "devs ") + ",".join(map(str, sorted(ids)))  # noqa: E731
    width = max([cell] + [len(label(v)) + 2 for v in g["blocks"].values()])
    bar = "+" + "+".join("-" * width for _ in g["cols"]) + "+"
    lines = [
        f"{path} {g['shape']} {g['spec']}: rows = dim {g['dims'][0]}"
        + (f", columns = dim {g['dims'][1]}" if len(g["dims"]) == 2 else ""),
        bar,
    ]
    for r in g["rows"]:
        cells = []
        for c in g["cols"]:
            ids = g["blocks"].get((r, c) if c is not None else (r,), [])
            cells.append(label(ids).center(width))
        rng = f" {r[0]}:{r[1]}"
        lines += ["|" + "|".join(cells) + "|" + rng, bar]
    if g["cols"] != [None]:
        lines.append(" " + " ".join(f"{c[0]}:{c[1]}".center(width) for c in g["cols"]))
    return "\n".join(lines)


def write_png(placement: Placement, path: str, out: str | Path) -> Path:
    """The same picture as a PNG: one rectangle per block, coloured by the devices that hold it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    g = layout(placement, path)
    fig = Figure(figsize=(7, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours: dict[Any, Any] = {}
    cmap = __import__("matplotlib").colormaps["tab20"]
    for key, ids in g["blocks"].items():
        r = key[0]
        c = key[1] if len(key) == 2 else (0, 1)
        colour = colours.setdefault(tuple(sorted(ids)), cmap(len(colours) % 20))
        ax.add_patch(Rectangle((c[0], r[0]), c[1] - c[0], r[1] - r[0], facecolor=colour, edgecolor="black"))
        ax.text(
            (c[0] + c[1]) / 2, (r[0] + r[1]) / 2, ",".join(map(str, sorted(ids))), ha="center", va="center", fontsize=8
        )
    height = g["shape"][g["dims"][0]]
    width = g["shape"][g["dims"][1]] if len(g["dims"]) == 2 else 1
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_xlabel(f"dim {g['dims'][1]}" if len(g["dims"]) == 2 else "")
    ax.set_ylabel(f"dim {g['dims'][0]}")
    ax.set_title(f"{path} {g['shape']} {g['spec']}: devices holding each block")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
