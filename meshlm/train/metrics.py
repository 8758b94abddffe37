"""Training metrics: model FLOPs, peak FLOP/s, MFU, and where they are written (JSONL, TensorBoard, PNG).

    flops_per_token = model_flops_per_token(cfg, seq_len)
    peak, source = resolve_peak(args.peak_tflops, cfg.dtype)
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

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig
from meshlm.train.console import TrainProgress, format_metrics, plural, print_metrics_line

# ---------------------------------------------------------------------------------------------- FLOPs


def model_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token, the numerator of MFU.

        flops = 6 * N  +  3 * n_layers * (2 matmuls * 2 * seq_len * n_heads * head_dim) * (1/2 if causal)

    N is every parameter except the input embedding table (a lookup, no FLOPs): the layers, the
    norms and the output head d_model x vocab. With tied embeddings the head *is* the embedding
    table, but its matmul still runs, so it is counted. 6 = 2 (multiply-add) x 3 (forward, and a
    backward that costs twice the forward). The attention term is the part 6N misses: per token
    and layer, QK^T and PV are each 2 * seq_len * n_heads * head_dim FLOPs forward; a causal mask
    halves the useful work (the PaLM convention, which counts no FLOPs of rematerialisation).
    """
    if seq_len <= 0:
        raise UsageError(f"seq_len={seq_len} must be a positive integer")
    n = cfg.num_params(include_embedding=False)  # includes the head (tied or not), excludes the lookup table
    attn_forward = 2 * 2 * seq_len * cfg.n_heads * cfg.head_dim * (0.5 if causal else 1.0)
    return float(6 * n + 3 * cfg.n_layers * attn_forward)


def step_flops(cfg: ModelConfig, seq_len: int, tokens: int, causal: bool = True) -> float:
    """Training FLOPs of one step that processes `tokens` tokens (global batch x seq_len)."""
    return model_flops_per_token(cfg, seq_len, causal) * tokens


# ----------------------------------------------------------------------------------------- peak FLOP/s

# Dense (no sparsity) peak matmul FLOP/s per device, matched against `device.device_kind` (lower-cased,
# first match wins). Columns: bf16/fp16 peak, float32 peak (None: not known, measure instead), source.
# float32: JAX's default matmul precision runs f32 dots as TF32 on NVIDIA tensor cores and as bf16
# passes on TPU (docs.jax.dev "Matmul precision"), so the ceiling is the TF32 peak on GPU and the bf16
# peak on TPU. Set --peak_tflops when you raise jax_default_matmul_precision.
PEAK_TABLE: list[tuple[str, float, float | None, str]] = [
    # NVIDIA H100 datasheet: SXM BF16 1979 / TF32 989 TFLOPS "with sparsity"; dense is half.
    (r"h100.*pcie", 756e12, 378e12, "NVIDIA H100 PCIe datasheet (dense BF16 756, TF32 378 TFLOPS)"),
    (r"h100", 989e12, 494.7e12, "NVIDIA H100 SXM datasheet (dense BF16 989, TF32 495 TFLOPS)"),
    # NVIDIA H200 datasheet: same Hopper tensor cores as H100 SXM (BF16 1979 sparse).
    (r"h200", 989e12, 494.7e12, "NVIDIA H200 datasheet (dense BF16 989, TF32 495 TFLOPS)"),
    # NVIDIA A100 datasheet: BF16 312, TF32 156 TFLOPS dense (both the 40GB and 80GB parts).
    (r"a100", 312e12, 156e12, "NVIDIA A100 datasheet (dense BF16 312, TF32 156 TFLOPS)"),
    # Google Cloud TPU system-architecture pages, "peak compute per chip" (bf16).
    (r"tpu v4$", 275e12, 275e12, "Cloud TPU v4 docs (275 bf16 TFLOPS per chip)"),
    (r"tpu v5 ?(lite|e)", 197e12, 197e12, "Cloud TPU v5e docs (197 bf16 TFLOPS per chip)"),
    (r"tpu v5p?$", 459e12, 459e12, "Cloud TPU v5p docs (459 bf16 TFLOPS per chip)"),
    (r"tpu v6 ?(lite|e)", 918e12, 918e12, "Cloud TPU v6e (Trillium) docs (918 bf16 TFLOPS per chip)"),
]


def detect_peak_flops(device: Any, dtype: str) -> tuple[float, str] | None:
    """(peak FLOP/s, source) for a jax Device or its `device_kind` string; None if not in PEAK_TABLE."""
    kind = device if isinstance(device, str) else device.device_kind
    for pattern, bf16, fp32, source in PEAK_TABLE:
        if re.search(pattern, kind.strip().lower()):
            peak = fp32 if str(dtype) in ("float32", "fp32", "f32") else bf16
            if peak is None:
                return None
            return peak, f"{kind} {dtype}: {source}"
    return None


def matmul_probe(dtype: str = "float32", size: int = 1024, seconds: float = 1.0, device: Any = None) -> float:
    """Measured matmul FLOP/s of one device (default: the first CPU device).

    Times a jitted chain of square `size` x `size` matmuls, after a warm-up call that also compiles
    it, for about `seconds`, and returns the best repetition (the closest to what the hardware can
    do). The weight is scaled by 1/sqrt(size) so values neither overflow nor turn denormal (slow).
    """
    import jax

    device = device or jax.devices("cpu")[0]
    n_chain = 4
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(key_x, (size, size), dtype), device)
    w = jax.device_put((jax.random.normal(key_w, (size, size)) / math.sqrt(size)).astype(dtype), device)

    @jax.jit
    def chain(x, w):
        return jax.lax.fori_loop(0, n_chain, lambda _, y: y @ w, x)

    chain(x, w).block_until_ready()  # compile + warm up
    best = math.inf
    deadline = time.perf_counter() + seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        chain(x, w).block_until_ready()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return n_chain * 2 * size**3 / best


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
    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        found = detect_peak_flops(dev, dtype)
        if found:
            return found
        probe = matmul_probe(dtype, size=4096, seconds=1.0, device=dev)
        return probe, f"measured {dtype} 4096^2 matmul on {dev.device_kind} (not in the table; set --peak_tflops)"
    probe = matmul_probe(dtype, size=1024, seconds=1.0)
    n_local = jax.local_device_count()
    return probe / n_local, f"measured {dtype} 1024^2 matmul on this CPU: {probe / 1e9:.1f} GFLOP/s / {plural(n_local, 'device')}"


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
    """Derives throughput and MFU from (tokens, seconds) and writes `metrics.jsonl`, `tb/`, `loss.png`.

    One JSON object per `log()` or `log_eval()` call, appended to OUTPUT_DIR/metrics.jsonl (so a resumed
    run continues the file; evaluation rows have `eval_loss` and no `loss`); non-finite numbers are
    written as null. `close()` plots every row of the file, the steps of earlier runs of the same
    output_dir included. `enabled=False` (every process but
    0 in a multi-host run) creates and writes nothing; `log()` still returns the metrics dict.
    """

    def __init__(self, output_dir: str | Path, *, flops_per_token: float, peak_flops_per_device: float,
                 n_devices: int, total_steps: int, log_every: int, enabled: bool = True, title: str = ""):
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
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.output_dir / "tb"))

    def should_log(self, step: int) -> bool:
        """True on every `log_every`-th step and on the last one."""
        return step % self.log_every == 0 or step == self.total_steps

    def log(self, step: int, *, loss: float, tokens: int, seconds: float, extra: dict | None = None) -> dict:
        """Record one log step; `tokens` and `seconds` are totals since the previous `log()`."""
        tokens_per_s = tokens / seconds if seconds > 0 else math.nan
        tflops = self.flops_per_token * tokens_per_s / self.n_devices / 1e12
        m: dict[str, Any] = {
            "step": int(step), "loss": _number(loss), "tokens": int(tokens), "seconds": float(seconds),
            "tokens_per_s": tokens_per_s, "tflops_per_device": tflops, "mfu": tflops * 1e12 / self.peak,
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
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._tb.add_scalar(prefix(k), v, m["step"])

    def close(self, title: str | None = None) -> None:
        """Flush/close the files and draw OUTPUT_DIR/loss.png from the whole metrics.jsonl. Safe to call twice."""
        if not self.enabled or self._file is None:
            return
        self._tb.close()
        self._file.close()
        self._file = self._tb = None
        from meshlm.train.plot import plot_run, read_metrics

        plot_run(self.output_dir / "loss.png", read_metrics(self.output_dir / "metrics.jsonl"),
                 title if title is not None else self.title)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "model_flops_per_token", "step_flops", "PEAK_TABLE", "detect_peak_flops", "matmul_probe", "resolve_peak",
    "MetricsLogger", "TrainProgress", "print_metrics_line", "format_metrics",  # the last three: meshlm.train.console
]
