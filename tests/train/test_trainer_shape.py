"""The training package reads in a screen: no function over 80 lines, the loop's top function at most
60, and no branch on whether LoRA is on (what trains is a `Trainable`)."""

import ast
import re
from pathlib import Path

import meshlm.train
from meshlm.train.loop import Trainer

TRAIN = Path(meshlm.train.__file__).parent


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_over_80_lines_and_the_loop_within_60():
    long = [(p.name, name, n) for p in TRAIN.rglob("*.py") for name, n in _functions(p) if n > 80]
    assert not long, long
    run = dict(_functions(Path(meshlm.train.loop.__file__)))["run"]
    assert run <= 60 and Trainer.run.__qualname__ == "Trainer.run", run


def test_no_lora_branch_in_train():
    found = [
        (p.name, m.group())
        for p in TRAIN.rglob("*.py")
        for m in re.finditer(r"lora is (not )?None|lora=", p.read_text())
    ]
    assert not found, found
