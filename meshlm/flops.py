"""What a training step costs and what the device can do: model FLOPs per token (the numerator of MFU)
and peak FLOP/s per device (datasheet table for accelerators, a measured matmul otherwise). Below both
the planner and the training loop, which report MFU with the same definition and peak."""

from __future__ import annotations

import math
import re
import time
from typing import Any

from meshlm.errors import UsageError
from meshlm.models.configs import ModelConfig

# ---------------------------------------------------------------------------------------------- FLOPs


def attended_keys(seq_len: int, window: int = 0, causal: bool = True) -> float:
    """Keys one query attends, averaged over a row of `seq_len` positions.

    Causal: the query at position p attends min(p + 1, window) keys (window 0: no window), with the
    diagonal counted half, so a global layer attends seq_len / 2 on average (the PaLM convention) and a
    window >= seq_len is the global count. Not causal: every query attends every key (a window is a
    causal notion here)."""
    if not causal:
        return float(seq_len)
    w = window if 0 < window < seq_len else seq_len
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len - 0.5


def mean_attended_keys(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """`attended_keys` averaged over the layers: global ones attend half the row, local ones about their
    window. A pipeline stage holds whole repeats of the local/global pattern (`meshlm.job` checks it),
    so each stage has the same mean."""
    kinds = cfg.local_layers
    return sum(attended_keys(seq_len, cfg.sliding_window if local else 0, causal) for local in kinds) / len(kinds)


def model_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token, the numerator of MFU.

        flops = 6 * N  +  3 * sum over layers (2 matmuls * 2 * keys(layer) * n_heads * head_dim)

    N is every parameter except the input embedding table (a lookup, no FLOPs): the layers with their
    biases and q/k and post norms, the final norm and the output head d_model x vocab. With tied
    embeddings the head *is* the embedding table, but its matmul still runs, so it is counted. 6 = 2
    (multiply-add) x 3 (forward, and a backward that costs twice the forward). The attention term is the
    part 6N misses: per token and layer, QK^T and PV are each 2 * keys * n_heads * head_dim FLOPs
    forward, where keys is what one query attends on average (`attended_keys`): seq_len / 2 for a causal
    global layer (the PaLM convention, which counts no FLOPs of rematerialisation), and for a local layer
    only its window, min(p + 1, sliding_window) keys at position p.
    """
    if seq_len <= 0:
        raise UsageError(f"seq_len={seq_len} must be a positive integer")
    n = cfg.num_params(include_embedding=False)  # includes the head (tied or not), excludes the lookup table
    keys = mean_attended_keys(cfg, seq_len, causal) * cfg.n_layers
    return float(6 * n + 3 * 2 * 2 * keys * cfg.n_heads * cfg.head_dim)


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
