"""meshlm's modules import only from below them: no import cycle, counting imports inside functions,
between modules or between sub-packages; argparse only in the CLI package; no module too long to read."""

import ast
import collections
from pathlib import Path

import meshlm

ROOT = Path(meshlm.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the meshlm modules it imports anywhere in its text (top level or inside functions).
    `from meshlm.x import y` counts as importing meshlm.x, and meshlm.x.y when y is a module."""
    modules = {_module_name(p): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in modules and t != name)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str:
    """meshlm.plan.search -> meshlm.plan; meshlm.job -> meshlm.job (a top-level module is its own unit)."""
    return ".".join(module.split(".")[:2])


def test_the_walker_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (a module must import only from below it): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_no_import_cycle_between_packages():
    graph = collections.defaultdict(set)
    for module, targets in import_graph().items():
        for t in targets:
            if _package(t) != _package(module):
                graph[_package(module)].add(_package(t))
    found = cycles(graph)
    assert not found, "sub-packages importing each other: " + "; ".join(" <-> ".join(c) for c in found)


# Rooms of meshlm.serve on floors: a room imports only from rooms on floors below it (the package's own
# modules, loading and lora_loading, are the room "meshlm.serve").
SERVE_FLOORS = {"meshlm.serve.engine": 0, "meshlm.serve": 0, "meshlm.serve.api": 1}


def _room(module: str, floors: dict[str, int]) -> str | None:
    """The longest room name that is `module` or a package above it; None outside every room."""
    rooms = [r for r in floors if module == r or module.startswith(r + ".")]
    return max(rooms, key=len) if rooms else None


def sideways_or_upward(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Imports from one room into another on the same floor or a higher one."""
    bad = []
    for module, targets in sorted(graph.items()):
        src = _room(module, floors)
        for t in sorted(targets):
            dst = _room(t, floors)
            if src and dst and src != dst and floors[dst] >= floors[src]:
                bad.append(f"{module} -> {t}")
    return bad


def test_the_floor_check_finds_an_upward_import():
    graph = {
        "meshlm.serve.engine.batching": {"meshlm.serve.api.errors"},
        "meshlm.serve.api.routes": {"meshlm.serve.engine.batching"},
        "meshlm.serve.loading": {"meshlm.serve.engine.shapes"},
    }
    assert sideways_or_upward(graph, SERVE_FLOORS) == [
        "meshlm.serve.engine.batching -> meshlm.serve.api.errors",
        "meshlm.serve.loading -> meshlm.serve.engine.shapes",
    ]


def test_serve_rooms_import_only_from_below():
    found = sideways_or_upward(import_graph(), SERVE_FLOORS)
    assert not found, "meshlm.serve: engine/ and loading stand apart, api/ above them: " + "; ".join(found)


def test_only_the_cli_parses_flags():
    users = sorted(
        name
        for name, path in ((_module_name(p), p) for p in ROOT.rglob("*.py"))
        if "argparse"
        in {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import) for a in n.names}
        and not name.startswith("meshlm.cli")
    )
    assert users == []


def test_modules_are_small_and_say_what_they_are_for():
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        lines = text.count("\n")
        assert lines <= 470, f"{path.relative_to(ROOT.parent)} has {lines} lines; split it by concern"
        if lines > 20:
            assert ast.get_docstring(ast.parse(text)), f"{path.relative_to(ROOT.parent)} opens with no docstring"


def test_benchmarks_import_what_exists():
    """bench/ scripts are not run by the suite: at least every meshlm name they import must exist."""
    import importlib
    import importlib.util

    for script in sorted((ROOT.parent / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshlm"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                        f"{script.name}: from {node.module} import {alias.name}"
                    )
