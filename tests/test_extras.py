"""The optional extras in pyproject.toml install what their documented commands import."""

import tomllib

from packaging.requirements import Requirement

from tests.support.cli import ROOT


def extras() -> dict[str, dict[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        name: {Requirement(r).name: Requirement(r) for r in reqs}
        for name, reqs in project["optional-dependencies"].items()
    }


def test_eval_extra_brings_the_tokenizer_lm_eval_uses_against_the_server():
    """docs/eval.md's `lm-eval run --model local-completions ... tokenizer_backend=huggingface` imports
    transformers; the eval extra installs it, in the range the tests run against."""
    found = extras()
    assert found["eval"]["lm_eval"] == found["test"]["lm_eval"]
    assert "transformers" in found["eval"], "the eval extra lacks transformers"
    assert found["eval"]["transformers"].specifier == found["test"]["transformers"].specifier
    assert "'.[eval]'" in (ROOT / "docs" / "eval.md").read_text()
