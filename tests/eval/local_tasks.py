"""Small local lm-eval tasks written into a folder: YAML files whose data is JSONL beside them
(`dataset_path: json`, `dataset_kwargs: {data_files: ...}`), made from a fixed seed.

  meshlm_mc<N>      multiple choice, N questions of 4 choices each (acc, acc_norm)
  meshlm_rolling    loglikelihood_rolling over documents longer than one window (perplexities)
  meshlm_gen        generate_until with a stop string and max_gen_toks (exact_match)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "def",
    "class",
    "return",
    "import",
    "self",
    "value",
    "list",
    "dict",
    "for",
    "while",
    "if",
    "else",
    "None",
    "True",
    "False",
    "print",
    "len",
    "range",
    "string",
    "number",
    "the",
    "data",
    "file",
    "path",
    "name",
    "line",
    "text",
    "key",
    "item",
    "error",
    "result",
    "index",
)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _metric(name: str, aggregation: str, higher_is_better: bool) -> str:
    return (
        f"  - metric: {name}\n    aggregation: {aggregation}\n    higher_is_better: {str(higher_is_better).lower()}\n"
    )


def _write(folder: Path, name: str, rows: list[dict], yaml: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n{yaml}"
    )


def multiple_choice(folder: Path, n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        choices = rng.sample(WORDS, 4)
        rows.append(
            {
                "question": f"{_sentence(rng, 5)} {choices[0]} {_sentence(rng, 3)} ?",
                "choices": choices,
                "answer": rng.randrange(4),
            }
        )
    name = f"meshlm_mc{n}"
    _write(
        folder,
        name,
        rows,
        "output_type: multiple_choice\nfewshot_split: test\n"
        "doc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n"
        + _metric("acc", "mean", True)
        + _metric("acc_norm", "mean", True),
    )
    return name


def rolling(folder: Path, n: int = 6, words: int = 150, seed: int = 1) -> str:
    rng = random.Random(seed)
    rows = [{"text": "\n".join(_sentence(rng, 10) for _ in range(words // 10))} for _ in range(n)]
    _write(
        folder,
        "meshlm_rolling",
        rows,
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{text}}\"\nmetric_list:\n"
        + _metric("word_perplexity", "weighted_perplexity", False)
        + _metric("byte_perplexity", "weighted_perplexity", False)
        + _metric("bits_per_byte", "bits_per_byte", False),
    )
    return "meshlm_rolling"


def generation(folder: Path, n: int = 6, seed: int = 2) -> str:
    rng = random.Random(seed)
    rows = [{"question": _sentence(rng, 6), "answer": rng.choice(WORDS)} for _ in range(n)]
    _write(
        folder,
        "meshlm_gen",
        rows,
        "output_type: generate_until\ndoc_to_text: \"{{question}} =\"\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\", \".\"]\n"
        "  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n" + _metric("exact_match", "mean", True),
    )
    return "meshlm_gen"


def write_tasks(folder: Path, mc_examples: int = 20) -> dict[str, str]:
    """The three tasks in `folder`: {"mc": name, "rolling": name, "gen": name}."""
    return {"mc": multiple_choice(folder, mc_examples), "rolling": rolling(folder), "gen": generation(folder)}
