"""The console of a training run: one-line metrics and evaluations, a progress bar, and wording helpers.

console = run_console(quiet=jax.process_index() != 0)   # never wraps lines in a log file
with TrainProgress(n, console=console) as bar:
    ...  print_metrics_line(m, console); bar.update(step, m)
plural(8, "device") == "8 devices"   (parameter counts: meshlm.models.configs.count_params)
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

_console = None


def run_console(quiet: bool = False, **kw):
    """A rich Console for a run's log: lines never wrap (a log file or a pipe, which rich would cut at 80
    columns, keeps every message on one line), and `quiet` prints nothing (processes other than 0)."""
    console = Console(quiet=quiet, soft_wrap=True, **kw)
    if not console.is_terminal and "width" not in kw:  # the final progress bar of a log: a wide one
        console = Console(quiet=quiet, soft_wrap=True, width=max(console.width, 160), **kw)
    return console


def _get_console():
    global _console
    if _console is None:
        _console = run_console()  # writes to whatever sys.stdout is at print time
    return _console


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 device`, `8 devices`, `1 process`, `2 processes` (the count with the right form of the word)."""
    return f"{n} {word if n == 1 else many or (word + ('es' if word.endswith(('s', 'x', 'sh', 'ch')) else 's'))}"


def format_metrics(m: dict) -> str:
    """One readable line: step, loss, tokens/s, TFLOP/s per device, MFU, and lr / grad norm if present."""
    parts = [f"step {m['step']:>6}", f"loss {m['loss']:.4f}" if m.get("loss") is not None else "loss -"]
    parts += [f"{m['tokens_per_s']:,.0f} tok/s", f"{m['tflops_per_device']:.3f} TFLOP/s/dev", f"MFU {m['mfu']:.1%}"]
    if m.get("lr") is not None:
        parts.append(f"lr {m['lr']:.2e}")
    if m.get("grad_norm") is not None:
        parts.append(f"gnorm {m['grad_norm']:.3f}")
    return " | ".join(parts)


def format_eval(m: dict) -> str:
    """One readable line of an evaluation: step, loss, perplexity, how many batches and tokens, time."""
    return (
        f"eval {m['step']:>6} | loss {m['eval_loss']:.4f} | perplexity {m['eval_perplexity']:,.2f} | "
        f"{plural(m['eval_batches'], 'batch')}, {m['eval_tokens']:,} tokens | {m['eval_seconds']:.1f}s"
    )


def print_metrics_line(metrics: dict, console: Any = None) -> None:
    """Print one metrics line; it goes above a running `TrainProgress` bar, so the log stays readable."""
    line = format_eval(metrics) if "eval_loss" in metrics and "loss" not in metrics else format_metrics(metrics)
    (console or _get_console()).print(line, highlight=False, markup=False, soft_wrap=True)


class TrainProgress:
    """A rich progress bar: step/total, elapsed, ETA and the latest loss, tok/s and MFU.

    Not on a TTY (CI, a log file) rich draws nothing while running and prints the final bar once,
    so only `print_metrics_line` lines reach the log. `enabled=False` makes every method a no-op.
    """

    def __init__(self, total_steps: int, enabled: bool = True, console: Any = None):
        self.total_steps, self.enabled = total_steps, enabled
        self._progress = self._task = None
        self._console = console

    def __enter__(self) -> TrainProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=self._console or _get_console(),
                transient=False,
                refresh_per_second=2,
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=self.total_steps)
        return self

    def update(self, step: int, metrics: dict | None = None) -> None:
        """Move the bar to `step`; with `metrics`, show its loss, tok/s and MFU."""
        if self._progress is None:
            return
        desc = None
        if metrics:
            loss = metrics.get("loss")
            desc = (f"loss {loss:.4f}" if loss is not None else "loss -") + (
                f" | {metrics['tokens_per_s']:,.0f} tok/s | MFU {metrics['mfu']:.1%}"
            )
        self._progress.update(self._task, completed=step, **({"description": desc} if desc else {}))

    def print_metrics(self, metrics: dict) -> None:
        """`print_metrics_line` on this bar's console, if enabled."""
        if self.enabled:
            print_metrics_line(metrics, self._console)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


__all__ = ["run_console", "plural", "format_metrics", "format_eval", "print_metrics_line", "TrainProgress"]
