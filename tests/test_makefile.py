"""`make clean` removes the virtualenv and caches but never the runs in outputs/; `make clean-outputs` does,
saying what it deletes."""

import shutil
import subprocess

import pytest

from tests.support.cli import ROOT


def dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    return subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_clean_keeps_the_runs():
    commands = dry_run("clean")
    assert "rm -rf .venv" in commands
    removed = [c for c in commands.splitlines() if c.startswith("rm ")]
    assert not any("outputs" in c for c in removed), removed
    assert "make clean-outputs deletes it" in commands


def test_clean_outputs_says_what_it_deletes():
    commands = dry_run("clean-outputs")
    assert "deleting outputs/" in commands and "rm -rf outputs" in commands


def test_readme_says_what_clean_keeps():
    text = (ROOT / "README.md").read_text()
    assert "`make clean-outputs`" in text and "also removes `.venv`" not in text
