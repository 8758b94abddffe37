"""The commands in the README and docs/ can be run as written: each training example writes its own
--output_dir (so one example never resumes another's run), and meshes given for `make run`'s tiny model
(`--model=tiny`, `--checkpoint=outputs/run`) divide its 4 heads and fill the devices named."""

import re

import pytest

from meshlm.models.presets import PRESETS
from tests.support.cli import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands(path):
    """Shell lines of the page's code blocks, backslash continuations joined (side-by-side columns too)."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
        line = ""
        for raw in block.splitlines():
            line += raw.rstrip().rstrip("\\") + " "
            if not raw.rstrip().endswith("\\"):
                out.append(line.strip())
                line = ""
    return out


def train_commands():
    for page in PAGES:
        for cmd in commands(page):
            if re.match(r"(\.venv/bin/)?meshlm train --", cmd) and "dp,fsdp,tp,sp" not in cmd:  # not the schematic
                yield page.name, cmd


@pytest.mark.parametrize("page, cmd", list(train_commands()))
def test_every_training_example_has_its_own_output_dir(page, cmd):
    assert cmd.count("--output_dir=") >= cmd.count("meshlm train "), f"{page}: {cmd}"


def test_training_examples_do_not_share_an_output_dir():
    seen = {}
    for page, cmd in train_commands():
        for out in re.findall(r"--output_dir=(\S+)", cmd):
            resumes = "resume" in cmd or out == "runs/a"  # README's resume-on-another-mesh example
            if out in seen and not resumes:
                assert seen[out] == cmd, f"{page}: {out} is also the folder of {seen[out]!r}"
            seen.setdefault(out, cmd)


TINY = PRESETS["tiny"]


@pytest.mark.parametrize(
    "page, cmd",
    [
        (p.name, c)
        for p in PAGES
        for c in commands(p)
        if "--mesh_dim=" in c and ("--model=tiny" in c or "--checkpoint=outputs/run " in c + " ")
    ],
)
def test_meshes_for_the_tiny_model_fit_it(page, cmd):
    mesh = re.search(r"--mesh_dim=(\S+)", cmd).group(1)
    if not re.fullmatch(r"-?\d+(,-?\d+){3}", mesh):
        return
    dp, fsdp, tp, sp = (int(x) for x in mesh.split(","))
    assert TINY.n_heads % tp == 0 and TINY.n_kv_heads % tp == 0, f"{page}: tp={tp} does not divide tiny's heads: {cmd}"
    devices = re.search(r"--devices=(\d+)", cmd)
    processes = re.search(r"--num_processes=(\d+)", cmd)
    if devices and -1 not in (dp, fsdp, tp, sp):
        assert dp * fsdp * tp * sp == int(devices.group(1)) * int(processes.group(1) if processes else 1), (
            f"{page}: {cmd}"
        )


def test_plan_page_says_what_auto_computes_in_on_cpu(monkeypatch):
    """`meshlm plan --dtype=auto` on `cpu` is train's dtype, bfloat16 on a CPU with bf16 matmul instructions,
    and its MFU probe runs in that dtype: the page must not say float32 alone."""
    from meshlm import platform

    monkeypatch.setattr(platform, "cpu_multiplies_bf16", lambda cpuinfo=None: True)
    assert platform.default_dtype("cpu") == "bfloat16"
    text = (ROOT / "docs" / "plan.md").read_text()
    assert "float32 on `cpu`, else bfloat16" not in text and "a float32 1024² matmul" not in text
    assert "bf16 matmul instructions" in text and "1024² matmul in the compute dtype" in text
