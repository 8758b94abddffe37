"""User rules from a TOML file (`--sharding_rules=F`), layered over the preset's tables.

    [logical]                 # logical axis -> mesh axes, over the preset's tables (params and activations;
    mlp = ["tp"]              #   [logical.params] or [logical.activations] for one of them)

    [[rules]]                 # ordered regex on parameter paths -> PartitionSpec; first match wins
    pattern = "mlp/(gate|up)"
    spec = ["", "fsdp", "tp"]

    [[layers]]                # a preset for a range of layers (inclusive); other layers keep --strategy
    range = [0, 15]
    strategy = "dp"

Paths are the tree's keys joined by `/`, searched with `re.search`; mistakes are one-line `UsageError`s.
docs/strategies.md ("The rules file") has the whole format.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec as P

from meshlm.axes import LOGICAL_AXES
from meshlm.errors import UsageError
from meshlm.mesh import AXES
from meshlm.sharding import MeshAxes, Strategy, as_tuple, logical_to_spec, replicate_short_kv_heads, spec_divides
from meshlm.strategy.presets import unknown_preset

MESH_AXES = (*AXES, "pp")
WHAT = ("params", "grads", "opt_state")


@dataclass(frozen=True)
class Rule:
    index: int  # 1-based, in file order
    pattern: str
    spec: tuple[MeshAxes, ...]

    @property
    def label(self) -> str:
        return f"rule #{self.index} {self.pattern!r}"


@dataclass(frozen=True)
class LayerRange:
    index: int
    first: int  # inclusive
    last: int  # inclusive
    preset: str
    strategy: Strategy | None = None  # resolved by `with_layer_strategies`


@dataclass(frozen=True)
class LayerGroup:
    """A run of consecutive layers under one strategy: its own stacked parameters and scan."""

    start: int
    stop: int  # exclusive
    strategy: Strategy

    @property
    def key(self) -> str:
        return f"{self.start}-{self.stop - 1}"


@dataclass(frozen=True)
class Rules:
    path: str
    logical_params: dict[str, MeshAxes]
    logical_activations: dict[str, MeshAxes]
    rules: tuple[Rule, ...] = ()
    layers: tuple[LayerRange, ...] = ()

    def over(self, strategy: Strategy) -> Strategy:
        """The strategy with the [logical] overrides on top of its tables."""
        if not self.logical_params and not self.logical_activations:
            return strategy
        return dataclasses.replace(
            strategy,
            name=f"{strategy.name}+{Path(self.path).name}",
            params={**strategy.params, **self.logical_params},
            activations={**strategy.activations, **self.logical_activations},
        )

    def with_layer_strategies(self, make: Callable[[str], Strategy]) -> Rules:
        """Each [[layers]] range with its strategy made from its preset name; a bad name is blamed on the
        file and the range, not on --strategy."""

        def one(r: LayerRange) -> LayerRange:
            if problem := unknown_preset(r.preset):
                raise UsageError(f"{self.path} [[layers]] #{r.index}: strategy = {r.preset!r}: {problem}")
            return dataclasses.replace(r, strategy=make(r.preset))

        return dataclasses.replace(self, layers=tuple(one(r) for r in self.layers))

    def groups(self, n_layers: int, main: Strategy) -> tuple[LayerGroup, ...]:
        """The layer groups, in order, covering every layer; () without [[layers]]."""
        if not self.layers:
            return ()
        owner: list[LayerRange | None] = [None] * n_layers
        for r in self.layers:
            if r.last >= n_layers:
                raise UsageError(
                    f"{self.path}: [[layers]] #{r.index} range [{r.first}, {r.last}] goes past the "
                    f"model's last layer {n_layers - 1}; use ranges within 0..{n_layers - 1}"
                )
            for i in range(r.first, r.last + 1):
                if owner[i] is not None:
                    raise UsageError(
                        f"{self.path}: [[layers]] #{owner[i].index} and #{r.index} both cover layer {i}; "
                        "make the ranges disjoint"
                    )
                owner[i] = r
        out: list[LayerGroup] = []
        for i, r in enumerate(owner):
            strategy = r.strategy if r is not None else main
            if out and out[-1].strategy is strategy:
                out[-1] = dataclasses.replace(out[-1], stop=i + 1)
            else:
                out.append(LayerGroup(i, i + 1, strategy))
        return tuple(out)


def _axes(value: Any, where: str) -> MeshAxes:
    """A TOML value (a mesh axis, a list of them, "" / [] / false for none) -> mesh axes."""
    if value in ("", None, False) or value == []:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(a, str) for a in names):
        raise UsageError(
            f"{where}: {value!r} is not a mesh axis or a list of them; use e.g. \"tp\" or [\"fsdp\", \"tp\"]"
        )
    for a in names:
        if a not in MESH_AXES:
            raise UsageError(f"{where}: unknown mesh axis {a!r}; the mesh axes are {', '.join(MESH_AXES)}")
    if len(set(names)) < len(names):
        raise UsageError(f"{where}: mesh axis listed twice in {names}")
    return names[0] if len(names) == 1 else tuple(names)


def _logical(table: dict, where: str) -> dict[str, MeshAxes]:
    out = {}
    for key, value in table.items():
        if key not in LOGICAL_AXES:
            raise UsageError(f"{where}: unknown logical axis {key!r}; the logical axes are {', '.join(LOGICAL_AXES)}")
        out[key] = _axes(value, f"{where} {key}")
    return out


def load(path: str | Path) -> Rules:
    """Read and check a rules file; every problem is one line naming the file and the entry."""
    where = str(path)
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"--sharding_rules={where}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--sharding_rules={where}: not valid TOML ({e})") from None
    if unknown := set(data) - {"logical", "rules", "layers"}:
        raise UsageError(
            f"{where}: unknown section [{sorted(unknown)[0]}]; the sections are [logical], [[rules]], [[layers]]"
        )
    logical = dict(data.get("logical", {}))
    per = {k: logical.pop(k) for k in ("params", "activations") if isinstance(logical.get(k), dict)}
    both = _logical(logical, f"{where} [logical]")
    lp = {**both, **_logical(per.get("params", {}), f"{where} [logical.params]")}
    la = {**both, **_logical(per.get("activations", {}), f"{where} [logical.activations]")}
    rules = []
    for i, r in enumerate(data.get("rules", []), 1):
        label = f"{where} rule #{i}"
        if not isinstance(r, dict) or set(r) != {"pattern", "spec"} or not isinstance(r["spec"], list):
            odd = sorted(set(r) - {"pattern", "spec"}) if isinstance(r, dict) else []
            named = f"unknown key {odd[0]!r}; " if odd else ""
            raise UsageError(
                f"{label}: {named}give exactly pattern = \"REGEX\" and spec = [..] (one entry per dimension, "
                "\"\" for a whole one)"
            )
        try:
            re.compile(r["pattern"])
        except re.error as e:
            raise UsageError(f"{label} {r['pattern']!r}: not a regular expression ({e})") from None
        spec = tuple(_axes(e, f"{label} {r['pattern']!r}") for e in r["spec"])
        used = [a for e in spec for a in as_tuple(e)]
        if dup := sorted({a for a in used if used.count(a) > 1}):
            raise UsageError(
                f"{label} {r['pattern']!r}: spec {list(r['spec'])} puts mesh axis {dup[0]!r} on two dimensions"
            )
        rules.append(Rule(i, r["pattern"], spec))
    layers = []
    for i, r in enumerate(data.get("layers", []), 1):
        rng = r.get("range") if isinstance(r, dict) else None
        if (
            not isinstance(rng, list)
            or len(rng) != 2
            or not all(isinstance(x, int) for x in rng)
            or not 0 <= rng[0] <= rng[1]
            or not isinstance(r.get("strategy"), str)
        ):
            raise UsageError(
                f"{where} [[layers]] #{i}: give range = [FIRST, LAST] (inclusive, 0-based) and strategy = \"PRESET\""
            )
        layers.append(LayerRange(i, rng[0], rng[1], r["strategy"]))
    return Rules(where, lp, la, tuple(rules), tuple(layers))


# ----------------------------------------------------------------------------------- resolution


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a/b/c": leaf}."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


@dataclass(frozen=True)
class Resolved:
    """Every parameter's layouts and where they came from."""

    specs: dict[str, dict[str, P]]  # what (params, grads, opt_state) -> path -> spec
    sources: dict[str, str]  # path -> "--strategy=fsdp_tp" / "rule #2 'mlp/down'" / ...


def _rule_spec(rule: Rule, path: str, logical: tuple, shape: tuple, table: dict, mesh) -> P:
    entries = list(rule.spec)
    if len(entries) == len(shape) - 1 and logical and logical[0] == "layers":
        entries = [table.get("layers")] + entries
    if len(entries) != len(shape):
        raise UsageError(
            f"{rule.label} gives parameter {path} {shape} a spec of {len(rule.spec)} entries; "
            f"give {len(shape)} (one per dimension)"
        )
    kept = [tuple(a for a in as_tuple(e) if mesh.shape.get(a, 1) > 1) for e in entries]
    return P(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


def resolve(
    logical: dict[str, tuple],
    shapes: dict[str, tuple],
    strategy_of: Callable[[str], tuple[Strategy, str]],
    rules: Rules | None,
    mesh,
) -> Resolved:
    """Specs of every parameter (flat paths): the table of its strategy, then the first matching rule."""
    specs: dict[str, dict[str, P]] = {w: {} for w in WHAT}
    sources: dict[str, str] = {}
    winner: dict[str, Rule] = {}
    matched: dict[int, list[str]] = {}
    for rule in rules.rules if rules else ():
        matched[rule.index] = [p for p in logical if re.search(rule.pattern, p)]
        if not matched[rule.index]:
            raise UsageError(
                f"{rules.path}: {rule.label} matches no parameter; the paths look like "
                f"{', '.join(list(logical)[:4])}, ..."
            )
        for p in matched[rule.index]:
            winner.setdefault(p, rule)
        if not any(winner[p] is rule for p in matched[rule.index]):
            first = matched[rule.index][0]
            raise UsageError(
                f"{rules.path}: {rule.label} never applies: {winner[first].label} takes parameter "
                f"{first} first (first match wins); remove one or reorder them"
            )
    for path, names in logical.items():
        strategy, source = strategy_of(path)
        shape = shapes[path]
        if path in winner:
            rule = winner[path]
            spec = _rule_spec(rule, path, names, shape, strategy.params, mesh)
            for w in WHAT:
                specs[w][path] = spec
            source, culprit = rule.label, f"{rule.label} gives parameter {path}"
        else:
            for w in WHAT:
                specs[w][path] = replicate_short_kv_heads(
                    logical_to_spec(names, strategy.table(w), mesh), names, shape, mesh
                )
            culprit = f"parameter {path} under {source}"
        for w in WHAT:
            if problem := spec_divides(specs[w][path], shape, mesh):
                raise UsageError(
                    f"{culprit} {shape} {w} spec {specs[w][path]}: {problem}; change the rule, --strategy or --mesh_dim"
                )
        sources[path] = source
    return Resolved(specs, sources)
