"""Each list of choices a flag takes is written once, in the module that implements the choices."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "meshlm"

# choice list -> (the module that declares it, the names it holds)
CHOICES = {
    "remat": ("meshlm/models/remat.py", {"none", "save_dots", "save_attn", "save_qkv_attn", "full"}),
    "attention": ("meshlm/ops/kernel_names.py", {"auto", "blockwise", "dense", "cudnn", "triton", "splash"}),
    "tracker": ("meshlm/config/sections.py", {"tensorboard", "wandb", "none"}),
    "loss_on": ("meshlm/data/chat.py", {"assistant", "all"}),
    "long_conversations": ("meshlm/data/chat.py", {"truncate", "drop"}),
}


def _literals(tree: ast.AST, keys: bool):
    """The string sets written as one tuple, list or set (and with `keys`, as a dict's keys; elsewhere a
    dict keyed by the choices holds data about each, e.g. the cost model's per-policy table)."""
    for node in ast.walk(tree):
        items = (
            node.elts
            if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            else node.keys
            if keys and isinstance(node, ast.Dict)
            else None
        )
        strings = {i.value for i in items or () if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        if len(strings) >= 2:
            yield strings


def _declarations(names: set[str], home: str) -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = str(path.relative_to(ROOT.parent))
        found += [name for strings in _literals(ast.parse(path.read_text()), name == home) if names <= strings]
    return found


@pytest.mark.parametrize("choice", list(CHOICES))
def test_each_list_of_choices_is_declared_once(choice):
    home, names = CHOICES[choice]
    assert _declarations(names, home) == [home]


def test_the_lora_targets_default_is_written_once():
    from meshlm.models.lora_options import DEFAULT_TARGETS

    found = [
        str(p.relative_to(ROOT.parent))
        for p in sorted(ROOT.rglob("*.py"))
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Constant) and n.value == DEFAULT_TARGETS
    ]
    assert found == ["meshlm/models/lora_options.py"]


def test_the_flags_take_the_declared_choices():
    from meshlm import config
    from meshlm.models import remat
    from meshlm.models.decoder import REMAT_POLICIES
    from meshlm.ops import kernels
    from meshlm.plan import remat as plan_remat

    assert config.REMAT == ("auto", *remat.POLICIES) and tuple(REMAT_POLICIES) == plan_remat.POLICIES == remat.POLICIES
    assert config.ATTENTION is kernels.KERNELS
