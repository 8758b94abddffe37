"""lm-evaluation-harness around a meshlm model: finding the tasks, running them, writing lm-eval's JSON
and a summary table.

    require_lm_eval()                                       # UsageError naming the install if it is missing
    manager, tasks = find_tasks(["hellaswag", "mine"], include_path="my_tasks/")  # UsageError with close names
    results, tracker = run_tasks(lm, tasks, manager, num_fewshot=0, limit=100, output_path="results/")
    paths = write_results(results, tracker)                 # lm-eval's own files and layout
    console.print(summary_table(results))

Task names are lm-eval's (groups, tags and globs too), or the names of task YAML files in
`include_path`, or paths to such files. A local task reads its data with lm-eval's usual
`dataset_path: json` and `dataset_kwargs: {data_files: ...}`.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

from meshlm.errors import UsageError

INSTALL = (
    "pip install -e '.[eval]' in meshlm's folder (.venv/bin/pip after `make`; lm-evaluation-harness, "
    "lm_eval[api]==0.4.13)"
)


def require_lm_eval() -> None:
    """UsageError, in one line naming the install, when lm-eval cannot be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError(f"`meshlm eval` needs lm-evaluation-harness, which is not installed: {INSTALL}") from None


def _is_file_spec(name: str) -> bool:
    return name.endswith((".yaml", ".yml"))


def _manager(include_path: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def find_tasks(names: list[str], include_path: str | None = None) -> tuple[Any, list[str]]:
    """(lm-eval TaskManager, the task names or YAML paths to run). A name that matches nothing is a
    UsageError listing the closest known names. Local tasks alone are indexed without lm-eval's
    hundreds of built-in ones (seconds faster)."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise UsageError("--tasks is empty; give task names like --tasks=hellaswag,arc_easy")
    for name in filter(_is_file_spec, names):
        if not Path(name).is_file():
            raise UsageError(f"--tasks: task file {name} does not exist")
    wanted = [n for n in names if not _is_file_spec(n)]
    manager = _manager(include_path, defaults=False) if include_path else None
    if manager is None or any(not manager.match_tasks([n]) for n in wanted):
        manager = _manager(include_path, defaults=True)
    missing = [n for n in wanted if not manager.match_tasks([n])]
    if missing:
        close = sorted({c for n in missing for c in difflib.get_close_matches(n, manager.all_tasks, n=5, cutoff=0.6)})
        hint = (
            f"; close names: {', '.join(close)}"
            if close
            else "; list them with `lm-eval ls tasks`, or give --include_path=FOLDER of task YAML files"
        )
        raise UsageError(f"--tasks: no task named {', '.join(missing)}{hint}")
    out: list[str] = []
    for name in names:
        for task in [str(Path(name).resolve())] if _is_file_spec(name) else manager.match_tasks([name]):
            if task not in out:
                out.append(task)
    return manager, out


def run_tasks(
    lm: Any,
    tasks: list[str],
    manager: Any,
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    log_samples: bool = False,
    seed: int = 1234,
    model_name: str = "meshlm",
    output_path: str | Path | None = None,
) -> tuple[dict, Any]:
    """(results, lm-eval's EvaluationTracker for `write_results`): lm-eval's `simple_evaluate` on this
    model (an lm-eval LM such as meshlm.eval.lm.MeshLM). `model_name` names it in the results."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=None if output_path is None else str(output_path))
    try:
        results = simple_evaluate(
            model=lm,
            model_args={"pretrained": model_name},
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            batch_size=getattr(lm, "batch_size", None),
            log_samples=log_samples,
            evaluation_tracker=tracker,
            task_manager=manager,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except OSError as e:  # requests', huggingface_hub's and datasets' network errors are OSErrors
        if not _network_error(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"--tasks: lm-eval could not download a task's data ({first}); run where the Hugging Face "
            "Hub is reachable, or with its datasets cached and HF_DATASETS_OFFLINE=1, or give local "
            "task files (--tasks=path/to/task.yaml or --include_path=FOLDER)"
        ) from None
    if results is None:  # only ranks other than 0 of a distributed lm-eval run get None
        raise RuntimeError("lm-eval returned no results")
    return results, tracker


def _network_error(e: BaseException | None) -> bool:
    """Whether an exception (or one it was raised from) is a failed download rather than a local fault."""
    seen = 0
    while e is not None and seen < 8:
        seen += 1
        module = type(e).__module__.split(".")[0]
        if isinstance(e, ConnectionError) or module in ("requests", "urllib3", "huggingface_hub", "httpx", "datasets"):
            return True
        e = e.__cause__ or e.__context__
    return False


def write_results(results: dict, tracker: Any) -> list[Path]:
    """lm-eval's files, as its own command writes them: `results_<date>.json` (and, when the results
    hold samples, `samples_<task>_<date>.jsonl` per task) in OUTPUT/<model name>/, or beside an
    OUTPUT that ends in `.json`. The paths written, results first."""
    results = dict(results)
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    failed = RuntimeError(f"lm-eval could not write its results under {tracker.output_path} (see the log above)")
    if not hasattr(tracker, "date_id"):  # lm-eval logs a failed write and carries on: say it here
        raise failed
    if samples:
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    folder = Path(tracker.output_path)
    if folder.suffix == ".json":
        written = [folder.with_name(f"{folder.stem}_{tracker.date_id}.json")]
        folder = folder.parent
    else:
        folder = folder / tracker.general_config_tracker.model_name_sanitized
        written = [folder / f"results_{tracker.date_id}.json"]
    if not written[0].is_file():
        raise failed
    return written + sorted(folder.glob(f"samples_*_{tracker.date_id}.jsonl"))


def read_samples(path: str | Path) -> list[dict]:
    """The per-sample records of a `samples_<task>_<date>.jsonl` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summary_table(results: dict, column: str = "results"):
    """A rich Table of every metric (and its standard error) per task, or per group with `column="groups"`."""
    from rich.table import Table

    table = Table(title="groups" if column == "groups" else None)
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("Task" if column == "results" else "Group", "left"),
        ("Version", "right"),
        ("Filter", "left"),
        ("n-shot", "right"),
        ("Metric", "left"),
        ("Value", "right"),
        ("Stderr", "right"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify, overflow="fold")
    for task, metrics in results.get(column, {}).items():
        label = str(metrics.get("alias", task))
        version, shots = results.get("versions", {}).get(task, ""), results.get("n-shot", {}).get(task, "")
        for key in sorted(metrics):
            metric, _, filt = key.partition(",")
            if key in ("alias", "name", "sample_len", "sample_count") or metric.endswith("_stderr"):
                continue
            err = metrics.get(f"{metric}_stderr,{filt}")
            table.add_row(
                label,
                str(version),
                filt,
                str(shots),
                metric,
                _number(metrics[key]),
                "" if err is None else f"± {_number(err)}",
            )
            label = version = shots = ""
    return table


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4e}"
    return str(value)


__all__ = ["INSTALL", "require_lm_eval", "find_tasks", "run_tasks", "write_results", "read_samples", "summary_table"]
