"""Every file path, module path and command-line flag that README.md, CONTRIBUTING.md, docs/*.md and the
module docstrings name exists: a renamed module, a moved test or a dropped flag fails here, not in a
reader's shell. Flags are checked against the option strings of the parsers meshlm's commands build,
the benchmark scripts' flags, and the few other tools' flags the pages quote."""

import argparse
import ast
import contextlib
import io
import re
from functools import cache
from pathlib import Path

import pytest

from tests.support.cli import ROOT

# Names shaped like a path that are not files of the tree, each with the code that makes it.
NOT_FILES = {
    "bench/.maxtext-venv": "bench/maxtext_compare.py",  # the MaxText virtualenv it installs on demand
    "meshlm/serve/step/B/n": "meshlm/serve/engine/multihost.py",  # a key of jax.distributed's key-value store
}
# Flags of other tools that the pages quote, with the tool.
OTHER_TOOLS = {"--model_args": "lm_eval", "--fix": "ruff check"}
PATH = re.compile(r"(?<![\w./-])((?:meshlm|bench|tests|docs|examples|\.ci)/[\w./-]*\w)")
MODULE = re.compile(r"(?<![\w./-])(meshlm(?:\.\w+)+)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_]*)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")  # a markdown link's target, relative to its page


def pages() -> list[Path]:
    return [
        p for p in (ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))) if p.exists()
    ]


def texts() -> dict[str, str]:
    """Each page's text and each meshlm module's docstring, by the path to name in a failure."""
    out = {str(p.relative_to(ROOT)): p.read_text() for p in pages()}
    for path in sorted((ROOT / "meshlm").rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if docstring:
            out[str(path.relative_to(ROOT))] = docstring
    return out


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (a package's: also its submodules)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.name == "__init__.py":
        names |= {p.stem for p in path.parent.glob("*.py")} | {p.parent.name for p in path.parent.glob("*/__init__.py")}
    return frozenset(names)


def missing_module(dotted: str) -> str | None:
    """Why `meshlm.a.b[.Name]` does not resolve, or None when it does."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        if (path := module_file(parts[:k])) is not None:
            rest = parts[k:]
            if rest and rest[0] not in top_level_names(path):
                return f"{'.'.join(parts[:k])} has no {rest[0]}"
            return None
    return "no such module"


@cache
def known_flags() -> frozenset[str]:
    """Option strings of every meshlm command's parsers (built by `meshlm COMMAND --help`), plus the
    benchmark scripts' flags."""
    from meshlm.cli import COMMANDS, main

    seen: set[str] = {"--version"}  # meshlm --version, answered before any parser is built
    add_argument = argparse._ActionsContainer.add_argument

    def recording(self, *args, **kwargs):
        action = add_argument(self, *args, **kwargs)
        seen.update(action.option_strings)
        return action

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse._ActionsContainer, "add_argument", recording)
        for command in COMMANDS:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                main([command, "--help"])
    for script in (ROOT / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                seen |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return frozenset(seen)


def test_named_paths_exist():
    missing = [
        f"{where}: {path}"
        for where, text in texts().items()
        for path in PATH.findall(text)
        if not (ROOT / path).exists() and path not in NOT_FILES
    ]
    assert not missing, "paths named that the tree does not hold:\n" + "\n".join(missing)


def test_linked_pages_exist():
    missing = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages()
        for target in LINK.findall(page.read_text())
        if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists()
    ]
    assert not missing, "links to files the tree does not hold:\n" + "\n".join(missing)


def test_named_non_files_are_made_by_their_code():
    for name, maker in NOT_FILES.items():
        prefix = name.rsplit("/", 2)[0] if name.startswith("meshlm/") else Path(name).name
        assert prefix in (ROOT / maker).read_text(), (name, maker)


def test_named_modules_exist():
    missing = [
        f"{where}: {dotted} ({why})"
        for where, text in texts().items()
        for dotted in MODULE.findall(text)
        if (why := missing_module(dotted))
    ]
    assert not missing, "modules named that do not exist:\n" + "\n".join(missing)


def test_named_flags_exist():
    known = known_flags()
    assert {"--mesh_dim", "--steps", "--port", "--tasks", "--to_hf"} <= known  # every command's parser was built
    missing = [
        f"{where}: {flag}"
        for where, text in texts().items()
        for flag in FLAG.findall(text)
        if flag not in known and flag not in OTHER_TOOLS and not flag.startswith("--xla_")
    ]
    assert not missing, "flags named that no parser defines:\n" + "\n".join(missing)


# Every module's docstring says what it holds in a screen; the reasoning is on its docs page.
SHORT_DOCSTRINGS = ["meshlm"]


def test_module_docstrings_fit_a_screen():
    paths = [
        p
        for name in SHORT_DOCSTRINGS
        for p in sorted((ROOT / name).rglob("*.py") if (ROOT / name).is_dir() else [ROOT / name])
    ]
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in paths
        if (n := len((ast.get_docstring(ast.parse(p.read_text()), clean=False) or "").splitlines())) > 15
    ]
    assert not long, "module docstrings over 15 lines (move the essay to docs/):\n" + "\n".join(long)


def test_a_stale_name_is_caught():
    assert missing_module("meshlm.ops.linear.NO_SUCH_NAME") == "meshlm.ops.linear has no NO_SUCH_NAME"
    assert missing_module("meshlm.no_such_package.x") == "meshlm has no no_such_package"
    assert missing_module("meshlm.serve") is None and missing_module("meshlm.flops.PEAK_TABLE") is None
    assert "--no_such_flag" not in known_flags()
    assert LINK.findall("[plan](docs/plan.md#flags) and [site](https://example.org)") == [
        "docs/plan.md",
        "https://example.org",
    ]
