"""Every function in meshlm/ reads in a screen: at most 80 lines from its `def` to its last line."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80


def function_lengths(package: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, "path:line name" with the path relative to `root`) of every function and method under `package`."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(root)}:{node.lineno} {node.name}"
                out.append((node.end_lineno - node.lineno + 1, where))
    return out


def test_no_function_over_80_lines():
    long = [f"{where}: {n} lines" for n, where in function_lengths(ROOT / "meshlm") if n > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(long)


def test_the_count_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert function_lengths(tmp_path, root=tmp_path) == [(MAX_LINES + 1, "m.py:1 f")]
