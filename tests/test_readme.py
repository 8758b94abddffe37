"""The README's Python example runs as written, in a fresh process (it sets up its own devices)."""

import re
import subprocess
import sys

from tests.support.cli import ROOT


def test_python_example_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using meshlm from Python") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loss = float(re.search(r"loss (\d+\.\d+)", result.stdout).group(1))
    assert 7.0 < loss < 12.0  # about ln(vocab) for a fresh model


def test_set_up_says_how_to_run_the_command_and_what_to_pass():
    """After `make run`, a new shell has no `meshlm` on PATH: the README says how to run it, that
    outputs/run is the checkpoint, and what the 2-minute model produces."""
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up") : text.index("## Choosing the mesh")]
    assert ".venv/bin/meshlm" in setup and "source .venv/bin/activate" in setup
    assert "--checkpoint=outputs/run" in setup and "meshlm --help" in setup
    assert "repeats a short fragment" in setup  # the greedy reply, said honestly


def test_opening_says_what_it_is_for_its_measured_comparisons_and_indexes_the_docs():
    text = (ROOT / "README.md").read_text()
    opening = text[: text.index("## Set-up")]
    assert "It is for" in opening
    rows = [line for line in opening.splitlines() if line.startswith("| ") and "bench/" in line]
    assert len(rows) >= 3 and all(line.count("|") >= 5 for line in rows), rows  # each figure: machine, command
    assert "MaxText" in opening and "levanter and torchtitan have not been measured" in opening
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in opening, f"docs/{page.name} missing from the index"
