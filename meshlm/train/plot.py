"""The loss curve of a whole run, `loss.png`, drawn from every row of its `metrics.jsonl`.

    rows = read_metrics(out / "metrics.jsonl")
    train, evals = curves(rows)            # {step: loss}: the last row of a step wins
    plot_run(out / "loss.png", rows, title="tiny on --mesh_dim=2,2,2,1")

A resumed run appends to metrics.jsonl, so the file holds every step since step 1; a step logged twice
(a run stopped between a log and the next checkpoint, then resumed) keeps its newest value. The plot
shows the training losses as faint points, a smoothed line over them (`smooth`), and the evaluation
losses as a second curve with markers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """Every JSON row of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def curves(rows: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """(training loss by step, evaluation loss by step), ascending, non-finite values left out."""
    train, evals = {}, {}
    for row in rows:
        if _finite(row.get("loss")):
            train[row["step"]] = float(row["loss"])
        if _finite(row.get("eval_loss")):
            evals[row["step"]] = float(row["eval_loss"])
    return dict(sorted(train.items())), dict(sorted(evals.items()))


def smooth(values: list[float], weight: float | None = None) -> list[float]:
    """An exponential moving average, debiased so it starts at the first value: weight 0.6 for a short
    run's few points, 0.9 from 100 points on."""
    if weight is None:
        weight = 0.6 if len(values) < 100 else 0.9
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def plot_run(png: str | Path, rows: list[dict], title: str = "") -> bool:
    """Write the curve to `png`; False (nothing written) when there is no finite loss to draw."""
    train, evals = curves(rows)
    if not train and not evals:
        return False
    # lazy: matplotlib loads only when a finished run draws its curves; Agg without touching pyplot's global state
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        steps, losses = list(train), list(train.values())
        ax.plot(steps, losses, linestyle="none", marker=".", markersize=4, alpha=0.45, color="C0", label="train")
        ax.plot(steps, smooth(losses), color="C0", label="train (smoothed)")
    if evals:
        ax.plot(list(evals), list(evals.values()), marker="o", markersize=4, color="C1", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png)
    return True


__all__ = ["read_metrics", "curves", "smooth", "plot_run"]
