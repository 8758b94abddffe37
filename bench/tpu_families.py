"""Gemma 2 9B and Qwen3 8B train steps compiled ahead of time for TPU v5p (libtpu, no TPU needed): the
per-device memory the TPU compiler's own `memory_analysis()` gives, the compile time, and both as ratios
to llama3-8b's train step compiled in the same run on the same mesh and shape.

Each step is `meshlm train`'s: bfloat16 compute, float32 parameters and AdamW moments, `--remat=full`,
splash attention (Gemma 2's local layers with its sliding-window mask and logit soft cap). The compiled
program is checked for Pallas TPU calls and for no XLA conditional (the blockwise kernel's block skipping).
Each compile takes minutes on 2 CPU cores.

Usage: python bench/tpu_families.py [--models gemma-2-9b,qwen3-8b] [--baseline llama3-8b]
       [--chips 4] [--mesh_dim 1,-1,1,1] [--seq 8192] [--batch_per_device 1] [--remat full]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling only: share libtpu with other processes

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshlm.mesh import parse_mesh_dim  # noqa: E402
from meshlm.models.policy import RunPolicy  # noqa: E402
from meshlm.models.presets import resolve_model  # noqa: E402
from meshlm.plan.job import Job  # noqa: E402

V5P_HBM = 95 * 2**30  # bytes of HBM per v5p chip
GIB = 2**30


def compile_on_v5p(model: str, args, overrides: dict | None = None) -> dict:
    """Compile `model`'s train step for `args.chips` v5p chips; its per-device figures and compile seconds."""
    from meshlm.explain.verify import compile_placed, measure, target_devices

    devices, where = target_devices(args.chips, "tpu-v5p")
    if not where.startswith("TPU"):
        raise SystemExit(f"no v5p topology of {args.chips} chips here ({where}): pip install -e '.[tpu]'")
    cfg = resolve_model(model, overrides)
    policy = RunPolicy(dtype="bfloat16", param_dtype="float32", remat=args.remat)
    shape = parse_mesh_dim(args.mesh_dim, args.chips)
    batch = args.batch_per_device * args.chips
    job = Job(cfg, batch_size=batch, seq_len=args.seq, n_devices=args.chips, policy=policy)
    start = time.perf_counter()
    compiled, _ = compile_placed(job, shape, devices)
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    return dict(
        measure(compiled),
        model=model,
        where=where,
        seconds=seconds,
        params=cfg.num_params(),
        pallas=text.count("tpu_custom_call"),
        conditionals=text.count(" conditional("),
        local=f"window {cfg.sliding_window}, pattern {cfg.layer_pattern or 'L'}" if cfg.sliding_window else "global",
    )


def report(got: dict, base: dict | None) -> str:
    ratio = ""
    if base is not None:
        ratio = (
            f" ({got['peak_memory_bytes'] / base['peak_memory_bytes']:.2f}x {base['model']}'s peak, "
            f"compile {got['seconds'] / base['seconds']:.2f}x)"
        )
    return (
        f"{got['model']:>11} ({got['params'] / 1e9:.2f}B, {got['local']}): per device peak "
        f"{got['peak_memory_bytes'] / GIB:.2f} GiB of {V5P_HBM / GIB:.0f}{ratio}, arguments "
        f"{got['argument_bytes'] / GIB:.2f} GiB, temporaries {got['temp_bytes'] / GIB:.2f} GiB; compiled in "
        f"{got['seconds']:.0f} s; Pallas TPU calls {got['pallas']}, XLA conditionals {got['conditionals']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gemma-2-9b,qwen3-8b")
    parser.add_argument("--baseline", default="llama3-8b", help="'' for none")
    parser.add_argument("--chips", type=int, default=4, help="4: v5p-8 (v5p:2x2x1); 8: v5p-16 (v5p:2x2x2)")
    parser.add_argument("--mesh_dim", default="1,-1,1,1", help="dp,fsdp,tp,sp (default: fsdp over every chip)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch_per_device", type=int, default=1)
    parser.add_argument("--remat", default="full")
    args = parser.parse_args()
    print(
        f"train step, batch {args.batch_per_device * args.chips} x {args.seq}, mesh {args.mesh_dim} on "
        f"{args.chips} v5p chips, bf16 compute, fp32 parameters and AdamW, remat {args.remat}"
    )
    base = None
    if args.baseline:
        base = compile_on_v5p(args.baseline, args)
        print(report(base, None), flush=True)
    for model in args.models.split(","):
        print(report(compile_on_v5p(model, args), base), flush=True)


if __name__ == "__main__":
    main()
