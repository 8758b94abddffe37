"""Collectives of a compiled program, read from its partitioned HLO text (`compiled.as_text()`).

Shared by `meshlm plan` (which checks its predictions against the compiler) and `meshlm explain`
(which lists what the compiler did):

- `parse_collectives`: every collective with its payload bytes, group size and executions per step;
- `on_mesh`: the same on a device mesh, with the mesh axes each collective's groups span.

A collective inside a `while` body counts once per iteration (`known_trip_count`, or on XLA:TPU the
loop's own bounds). Bytes are payload bytes (the buffer the collective is about, unsharded over its
group), which do not depend on how a backend lowers a reduction; wire time is `meshlm.plan.comms`'s.
docs/plan.md, "Reading collectives from compiled HLO", has the details.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s4": 1,
    "u4": 1,
}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLEE = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclass(frozen=True)
class Collective:
    """One collective instruction and how often it runs per step."""

    kind: str  # one of KINDS
    payload_bytes: int  # per execution, see the module docstring
    group_size: int  # devices taking part together (1 for a no-op)
    count: int  # executions per step (product of enclosing loop trip counts)
    op_name: str  # the JAX source op, from the metadata (for reading, not for logic)

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes * self.count


@dataclass(frozen=True)
class MeshCollective:
    """A collective over more than one device, placed on the mesh (see `on_mesh`)."""

    kind: str
    axes: tuple[str, ...]  # mesh axes the devices of one group differ in
    payload_bytes: int  # per execution
    count: int  # executions per step
    op_name: str  # the JAX source op without the `jit(step)/` prefix; '' when the metadata has none
    result_shapes: tuple[tuple[int, ...], ...]  # of the instruction's result (a tuple for async starts)

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes * self.count


# ------------------------------------------------------------------------------------ instructions


def array_bytes(shape_text: str) -> list[int]:
    """Byte sizes of every array in a (possibly tuple) HLO shape, e.g. `(f32[2,3]{1,0}, bf16[4])`."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in DTYPE_BYTES:
            continue
        out.append(DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return out


def array_shapes(shape_text: str) -> list[tuple[int, ...]]:
    """Dimensions of every array in an HLO shape."""
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(shape_text)]


def group_size(attrs: str) -> int:
    """Devices per replica group, from any of the three spellings XLA prints."""
    m = re.search(r"replica_groups=\{(\{[^}]*\})", attrs)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x.strip()])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m.group(2)))
    if "source_target_pairs" in attrs:
        return 2
    return 1


def computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    """Instruction lines of each computation, and the name of the entry computation."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _instructions(lines: list[str]) -> dict[str, tuple[str, str, str]]:
    """name -> (shape, opcode, operands and attributes) of a computation's instructions."""
    out = {}
    for line in lines:
        if m := _INSTR.match(line):
            out[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return out


def _operands(rest: str) -> list[str]:
    """Operand names of an instruction (the text inside its parentheses, shapes left out)."""
    depth, end = 1, 0
    for position, ch in enumerate(rest):
        end = position
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _constant(instrs: dict, name: str | None, depth: int = 0) -> int | None:
    """The integer a scalar instruction holds, through copies and bitcasts; None when it is computed."""
    shape, op, rest = instrs.get(name, ("", "", ""))
    if op == "constant":
        m = re.match(r"\s*(-?\d+)\)", rest)
        return int(m.group(1)) if m else None
    if op in ("copy", "bitcast", "convert") and depth < 8 and (args := _operands(rest)):
        return _constant(instrs, args[0], depth + 1)
    return None


def _tuple_index(instrs: dict, name: str | None) -> int | None:
    """k when the instruction is get-tuple-element(parameter, index=k), through copies."""
    shape, op, rest = instrs.get(name, ("", "", ""))
    if op == "copy" and (args := _operands(rest)):
        return _tuple_index(instrs, args[0])
    m = re.search(r"index=(\d+)", rest)
    return int(m.group(1)) if op == "get-tuple-element" and m else None


def inferred_trip_count(comps: dict[str, list[str]], caller: dict, while_rest: str) -> int | None:
    """Iterations of a `while` that carries no `known_trip_count` (XLA:TPU prints none): its condition
    compares one tuple element with a constant (`i < n`), the body adds a constant to that element and
    the caller starts it from a constant. None when the loop is not of that form."""
    cond = re.search(r"condition=%?([\w.\-]+)", while_rest)
    body = re.search(r"body=%?([\w.\-]+)", while_rest)
    if not cond or not body or cond.group(1) not in comps or body.group(1) not in comps:
        return None
    c_instrs = _instructions(comps[cond.group(1)])
    root = next(
        (m.group(1) for line in comps[cond.group(1)] if line.lstrip().startswith("ROOT") and (m := _INSTR.match(line))),
        None,
    )
    if root is None or c_instrs[root][1] != "compare":
        return None
    direction = re.search(r"direction=(\w+)", c_instrs[root][2])
    a, b = ([*_operands(c_instrs[root][2]), None, None])[:2]
    if (limit := _constant(c_instrs, b)) is not None and (k := _tuple_index(c_instrs, a)) is not None:
        d = direction.group(1) if direction else "LT"
    elif (limit := _constant(c_instrs, a)) is not None and (k := _tuple_index(c_instrs, b)) is not None:
        d = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction.group(1) if direction else "", "NE")
    else:
        return None
    # The start: element k of the tuple the while takes.
    args = _operands(while_rest)
    init = 0
    if args and caller.get(args[0], ("", "", ""))[1] == "tuple":
        elems = _operands(caller[args[0]][2])
        if k < len(elems) and (v := _constant(caller, elems[k])) is not None:
            init = v
    # The step: element k of the body's root tuple, i + constant.
    b_instrs = _instructions(comps[body.group(1)])
    step = 1
    broot = next(
        (m for line in comps[body.group(1)] if line.lstrip().startswith("ROOT") and (m := _INSTR.match(line))), None
    )
    if broot is not None and broot.group(3) == "tuple" and k < len(elems := _operands(broot.group(4))):
        name = elems[k]
        while b_instrs.get(name, ("", "", ""))[1] == "copy" and _operands(b_instrs[name][2]):
            name = _operands(b_instrs[name][2])[0]
        if b_instrs.get(name, ("", "", ""))[1] == "add":
            step = next((v for x in _operands(b_instrs[name][2]) if (v := _constant(b_instrs, x)) is not None), 1)
    if step == 0:
        return None
    span = {
        "LT": limit - init,
        "LE": limit - init + 1,
        "NE": limit - init,
        "GT": init - limit,
        "GE": init - limit + 1,
    }.get(d)
    if span is None:
        return None
    return max(0, -(-span // abs(step)))


def _continues_async(line: str, callee: str) -> bool:
    """Whether this call runs a later part of an asynchronous collective fusion (XLA:TPU's
    `async-collective-start` / `-done` fusions and the compute fused with its continuation): each
    holds a copy of the collective, which runs once, at the start."""
    m = _INSTR.match(line)
    return callee.startswith("async_collective_fusion") or bool(m and m.group(1).startswith("async-collective-done"))


def multipliers(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        instrs = None
        for line in lines:
            trip = _TRIP.search(line)
            n = int(trip.group(1)) if trip else None
            if n is None and " while(" in line and (m := _INSTR.match(line)):
                instrs = instrs if instrs is not None else _instructions(lines)
                n = inferred_trip_count(comps, instrs, m.group(4))
            for role, callee in _CALLEE.findall(line):
                factor = n if n is not None and role in ("body", "condition") else 1
                if _continues_async(line, callee):
                    continue
                calls[name].append((callee, factor))
            for group in _BRANCHES.findall(line):
                calls[name].extend((c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip())
    mult: dict[str, int] = defaultdict(int)
    roots = [entry] if entry else list(comps)

    def visit(name: str, factor: int, depth: int = 0) -> None:
        if depth > 64:
            return
        mult[name] += factor
        for callee, f in calls.get(name, ()):
            visit(callee, factor * f, depth + 1)

    for root in roots:
        visit(root, 1)
    return mult


def _collective_lines(text: str) -> Iterator[tuple[re.Match, int]]:
    """(the matched instruction, executions per step) of every collective that runs: an async pair is
    read at its `-start`, which carries the shapes."""
    comps, entry = computations(text)
    mult = multipliers(comps, entry)
    for name, lines in comps.items():
        count = mult.get(name, 0)
        if count == 0:
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m or m.group(3).endswith("-done"):
                continue
            if m.group(3).removesuffix("-start") in KINDS:
                yield m, count


def _read(m: re.Match, count: int) -> Collective:
    shape, op, rest = m.group(2), m.group(3), m.group(4)
    kind = op.removesuffix("-start")
    result = array_bytes(shape)
    if op.endswith("-start") and shape.lstrip().startswith("(") and kind in ("all-gather", "collective-permute"):
        # (operands..., results..., u32[] contexts...): XLA:TPU appends the contexts.
        result = array_bytes(re.sub(r"u32\[\][^,)]*", "", shape))
        ins, outs = result[: len(result) // 2], result[len(result) // 2 :]
        result = outs if kind == "all-gather" else ins
    if kind == "all-gather":
        payload = sum(result)
    else:  # reduce-scatter, all-reduce, all-to-all, collective-permute: what goes in
        operands = array_bytes(rest.split(")", 1)[0])
        payload = sum(operands) if operands else sum(result)
    meta = re.search(r'op_name="([^"]*)"', rest)
    return Collective(kind, payload, group_size(rest), count, meta.group(1) if meta else "")


def parse_collectives(text: str) -> list[Collective]:
    """Every collective in the HLO module with its per-step execution count."""
    return [_read(m, count) for m, count in _collective_lines(text)]


def summarize(collectives: list[Collective]) -> dict[str, int]:
    """Payload bytes per step by kind, plus `total`; collectives over a group of one are dropped."""
    out = dict.fromkeys(KINDS, 0)
    for c in collectives:
        if c.group_size > 1:
            out[c.kind] += c.total_bytes
    out["total"] = sum(out[k] for k in KINDS)
    return out


# ------------------------------------------------------------------------------------ mesh axes


def first_group(attrs: str, n: int) -> list[int] | None:
    """Device ids of the first replica group (or of a source-target pair that moves), from any
    spelling XLA prints; n is the number of devices."""
    if m := re.search(r"replica_groups=\{\{([^}]*)\}", attrs):
        return [int(x) for x in m.group(1).split(",") if x.strip()]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        ids = np.arange(n).reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2)))[0].tolist()
    if m := re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", attrs
    ):
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        keep = set(re.findall(r"'([^']+)'", m.group(4)))
        ids = np.arange(n)
        if m.group(2):  # the devices in mesh order, as an iota reshaped and transposed
            ids = ids.reshape([int(d) for d in m.group(2).split(",")])
            ids = ids.transpose([int(d) for d in m.group(3).split(",")]) if m.group(3) else ids
        ids = ids.reshape([int(s) for _, s in names])
        return ids[tuple(slice(None) if name in keep else 0 for name, _ in names)].ravel().tolist()
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs):
        pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
        return list(next((p for p in pairs if p[0] != p[1]), pairs[0] if pairs else ()))  # a device that moves
    return None


def axes_of(ids: list[int] | None, mesh) -> tuple[str, ...]:
    """The mesh axes along which these devices differ (a `jax.sharding.Mesh`)."""
    if not ids:
        return ()
    coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in ids])
    return tuple(name for k, name in enumerate(mesh.axis_names) if len(set(coords[:, k])) > 1)


def on_mesh(text: str, mesh) -> list[MeshCollective]:
    """Every collective over more than one device, with the mesh axes its groups span.

    A reduce-scatter printed without operand shapes is counted by its input (group × result), as the
    other kinds are; `parse_collectives` keeps the result there."""
    out = []
    for m, count in _collective_lines(text):
        c = _read(m, count)
        if c.group_size <= 1:
            continue
        payload = c.payload_bytes
        if c.kind == "reduce-scatter" and not array_bytes(m.group(4).split(")", 1)[0]):
            payload *= c.group_size
        axes = axes_of(first_group(m.group(4), mesh.devices.size), mesh)
        out.append(
            MeshCollective(
                c.kind, axes, payload, count, c.op_name.removeprefix("jit(step)/"), tuple(array_shapes(m.group(2)))
            )
        )
    return out
