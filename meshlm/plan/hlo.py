"""Collectives of a compiled program, read from its partitioned HLO text (`compiled.as_text()`).

Every device runs the same SPMD program, so the collectives in the text are what *each* device
takes part in. A collective inside a `while` body (the scan over layers, gradient accumulation) runs
once per iteration: its bytes are multiplied by the loop's `known_trip_count`, and nested loops
multiply.

Bytes are *payload* bytes: the size of the buffer the collective is about, unsharded over its
group — the gathered result of an all-gather, the input of a reduce-scatter or all-reduce, the
buffer a collective-permute sends. That measure does not depend on how a backend lowers a
reduction (XLA:CPU writes reduce-scatter as all-reduce + slice; GPU and TPU keep reduce-scatter),
so predictions can be checked on simulated CPU devices. Wire time is a different figure: see
`meshlm.plan.comms`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
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


def _array_bytes(shape_text: str) -> list[int]:
    """Byte sizes of every array in a (possibly tuple) HLO shape, e.g. `(f32[2,3]{1,0}, bf16[4])`."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        out.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return out


def _group_size(attrs: str) -> int:
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


def _computations(text: str) -> tuple[dict[str, list[str]], str | None]:
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


def _multipliers(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            for role, callee in _CALLEE.findall(line):
                factor = int(trip.group(1)) if trip and role in ("body", "condition") else 1
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


def parse_collectives(text: str) -> list[Collective]:
    """Every collective in the HLO module with its per-step execution count."""
    comps, entry = _computations(text)
    mult = _multipliers(comps, entry)
    out = []
    for name, lines in comps.items():
        count = mult.get(name, 0)
        if count == 0:
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            shape, op, rest = m.group(2), m.group(3), m.group(4)
            if op.endswith("-done"):
                continue  # the matching -start carries the shapes
            kind = op.removesuffix("-start")
            if kind not in KINDS:
                continue
            result = _array_bytes(shape)
            operands = _array_bytes(rest.split(")", 1)[0])
            if kind == "all-gather":
                # all-gather-start returns (operands..., results...): the gathered half is the larger.
                payload = sum(result[len(result) // 2:]) if op.endswith("-start") else sum(result)
            elif kind in ("reduce-scatter", "all-reduce", "all-to-all", "collective-permute"):
                payload = sum(operands) if operands else sum(result)
            size = _group_size(rest)
            meta = re.search(r'op_name="([^"]*)"', rest)
            out.append(Collective(kind, payload, size, count, meta.group(1) if meta else ""))
    return out


def summarize(collectives: list[Collective]) -> dict[str, int]:
    """Payload bytes per step by kind, plus `total`; collectives over a group of one are dropped."""
    out = dict.fromkeys(KINDS, 0)
    for c in collectives:
        if c.group_size > 1:
            out[c.kind] += c.total_bytes
    out["total"] = sum(out[k] for k in KINDS)
    return out
