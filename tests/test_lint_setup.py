"""The developer loop is wired: `make lint` installs and runs ruff (lint and the formatter's check) and mypy,
CI runs it before the tests, and the pre-commit hooks run the same installed tools."""

import re
import shutil
import subprocess
import tomllib

import pytest

from tests.support.cli import ROOT


def test_make_lint_installs_and_runs_ruff_and_mypy():
    if shutil.which("make") is None:
        pytest.skip("no make")
    commands = subprocess.run(["make", "-n", "-B", "lint"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert re.search(r"pip install -q ruff==\S+ mypy==\S+", commands), commands
    for tool in (".venv/bin/ruff check .", ".venv/bin/ruff format --check .", ".venv/bin/mypy"):
        assert tool in commands, (tool, commands)


def test_ci_lints_before_it_tests():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert lines.index("make lint") < lines.index("make test")


def test_pre_commit_runs_the_tools_make_lint_installs():
    text = (ROOT / ".pre-commit-config.yaml").read_text()
    for entry in (".venv/bin/ruff check", ".venv/bin/ruff format", ".venv/bin/mypy"):
        assert f"entry: {entry}" in text, entry


def test_each_ignored_rule_says_why():
    text = (ROOT / "pyproject.toml").read_text()
    ignored = tomllib.loads(text)["tool"]["ruff"]["lint"]["ignore"]
    block = text[text.index("ignore = [") :]
    for rule in ignored:
        before = block[: block.index(f'"{rule}"')].rstrip().splitlines()
        assert before[-1].lstrip().startswith("#"), f"{rule} is ignored without a reason above it"
