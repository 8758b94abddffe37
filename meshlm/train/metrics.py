"""Training metrics: the peak FLOP/s MFU is measured against, MFU, and where they are written (JSONL,
a tracker — TensorBoard, wandb or none, meshlm.train.tracking — and PNG). The FLOPs of a step and the peak table live in meshlm.flops.

    flops_per_token = model_flops_per_token(cfg, seq_len)
    peak, source = resolve_peak(args.peak_tflops, policy.dtype)
    logger = MetricsLogger(out, flops_per_token=flops_per_token, peak_flops_per_device=peak,
                           n_devices=jax.device_count(), total_steps=n, log_every=10,
                           enabled=jax.process_index() == 0, title="tiny on dp=2,fsdp=4")
    with TrainProgress(n, enabled=jax.process_index() == 0) as bar:
        ...  m = logger.log(step, loss=l, tokens=t, seconds=s, extra={"lr": lr, "grad_norm": g})
        ...  print_metrics_line(m); bar.update(step, m)
        ...  e = logger.log_eval(step, {"eval_loss": 5.1, "eval_perplexity": 164.0, ...})
    logger.close()   # loss.png: the whole run, read back from metrics.jsonl (meshlm.train.plot)

The console side (one-line metrics, the progress bar) is meshlm.train.console.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import jax

from meshlm.errors import UsageError
from meshlm.flops import detect_peak_flops, matmul_probe
from meshlm.train import plot
from meshlm.train.console import TrainProgress, format_metrics, plural, print_metrics_line
from meshlm.train.tracking import open_tracker


def resolve_peak(peak_tflops: float | None, dtype: str) -> tuple[float, str]:
    """Peak FLOP/s per device for MFU, and a sentence saying where it came from.

    Order: `--peak_tflops` (the user knows best) > the datasheet table for accelerators > a measured
    matmul probe (CPU, or an accelerator not in the table). On CPU the simulated devices of
    `--xla_force_host_platform_device_count` share the host's cores, so the host's measured rate is
    split evenly among them: MFU then reads as "share of what this machine's matmul achieves".
    """
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise UsageError(f"--peak_tflops={peak_tflops} must be a positive number of TFLOP/s per device")
        return peak_tflops * 1e12, f"--peak_tflops={peak_tflops:g}"
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        found = detect_peak_flops(dev, dtype)
        if found:
            return found
        probe = matmul_probe(dtype, size=4096, seconds=1.0, device=dev)
        return probe, f"measured {dtype} 4096^2 matmul on {dev.device_kind} (not in the table; set --peak_tflops)"
    probe = matmul_probe(dtype, size=1024, seconds=1.0)
    n_local = jax.local_device_count()
    return (
        probe / n_local,
        f"measured {dtype} 1024^2 matmul on this CPU: {probe / 1e9:.1f} GFLOP/s / {plural(n_local, 'device')}",
    )


# ------------------------------------------------------------------------------------------- logging


def _number(v: Any) -> Any:
    """A Python int/float from a Python or NumPy/JAX scalar; non-numbers are returned unchanged."""
    if isinstance(v, (bool, str)) or v is None:
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return int(f) if isinstance(v, int) else f


def _json_safe(v: Any) -> Any:
    """NaN/inf become null so every line is strict JSON."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


class MetricsLogger:
    """Derives throughput and MFU from (tokens, seconds) and writes `metrics.jsonl`, the tracker's files
    (`tracker`: tensorboard's `tb/`, wandb or none), `loss.png`.

    One JSON object per `log()` or `log_eval()` call, appended to OUTPUT_DIR/metrics.jsonl (so a resumed
    run continues the file; evaluation rows have `eval_loss` and no `loss`); non-finite numbers are
    written as null. `close()` plots every row of the file, the steps of earlier runs of the same
    output_dir included. `enabled=False` (every process but
    0 in a multi-host run) creates and writes nothing; `log()` still returns the metrics dict.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        flops_per_token: float,
        peak_flops_per_device: float,
        n_devices: int,
        total_steps: int,
        log_every: int,
        enabled: bool = True,
        title: str = "",
        tracker: str = "tensorboard",
        run_config: dict | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.flops_per_token, self.peak = float(flops_per_token), float(peak_flops_per_device)
        self.n_devices, self.total_steps, self.log_every = n_devices, total_steps, max(1, log_every)
        self.enabled, self.title = enabled, title
        self.history: list[tuple[int, float]] = []
        self._file = self._tb = None
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            path = self.output_dir / "metrics.jsonl"
            torn = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
            self._file = open(path, "a", buffering=1)
            if torn:  # a run killed mid-line: the next row starts on a line of its own
                self._file.write("\n")
            self._tb = open_tracker(tracker, self.output_dir, config=run_config)

    def should_log(self, step: int) -> bool:
        """True on every `log_every`-th step and on the last one."""
        return step % self.log_every == 0 or step == self.total_steps

    def log(self, step: int, *, loss: float, tokens: int, seconds: float, extra: dict | None = None) -> dict:
        """Record one log step; `tokens` and `seconds` are totals since the previous `log()`."""
        tokens_per_s = tokens / seconds if seconds > 0 else math.nan
        tflops = self.flops_per_token * tokens_per_s / self.n_devices / 1e12
        m: dict[str, Any] = {
            "step": int(step),
            "loss": _number(loss),
            "tokens": int(tokens),
            "seconds": float(seconds),
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak,
        }
        m.update({k: _number(v) for k, v in (extra or {}).items()})
        if not self.enabled:
            return m
        self.history.append((m["step"], m["loss"]))
        self._write(m)
        return m

    def log_eval(self, step: int, result: dict) -> dict:
        """Record one evaluation (`meshlm.train.evaluate.Evaluator`'s result); TensorBoard tags `eval/...`."""
        m = {"step": int(step), **{k: _number(v) for k, v in result.items()}}
        if self.enabled:
            self._write(m, prefix=lambda k: k.replace("eval_", "eval/", 1))
        return m

    def _write(self, m: dict, prefix=lambda k: k) -> None:
        self._file.write(json.dumps({k: _json_safe(v) for k, v in m.items()}, allow_nan=False) + "\n")
        if self._tb is not None:
            self._tb.log(
                {
                    prefix(k): v
                    for k, v in m.items()
                    if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                },
                m["step"],
            )

    @contextlib.contextmanager
    def closed_on_error(self):
        """Within this block an exception closes the event and metrics files (no plot) before it goes on:
        an open TensorBoard writer would otherwise end the process with a traceback of its own thread."""
        try:
            yield
        except BaseException:
            self._close_files()
            raise

    def _close_files(self) -> bool:
        """Close the event and metrics files; whether they were open."""
        if self._file is None:
            return False
        if self._tb is not None:
            self._tb.close()
        self._file.close()
        self._file = self._tb = None
        return True

    def close(self, title: str | None = None) -> None:
        """Flush/close the files and draw OUTPUT_DIR/loss.png from the whole metrics.jsonl. Safe to call twice."""
        if not self.enabled or not self._close_files():
            return
        plot.plot_run(
            self.output_dir / "loss.png",
            plot.read_metrics(self.output_dir / "metrics.jsonl"),
            title if title is not None else self.title,
        )

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "resolve_peak",
    "MetricsLogger",
    "TrainProgress",
    "print_metrics_line",
    "format_metrics",  # the last three: meshlm.train.console
]
