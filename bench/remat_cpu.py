"""Which --remat policy and attention kernel train fastest on this CPU: tokens/s of each, against
`--remat=none` with dense attention measured in the same process.

Why it exists: `--remat=auto` on CPU means `none` while a step's scratch fits in the 64 MiB block the
host allocator keeps between steps and `save_qkv_attn` beyond that, and `--attention=auto` on CPU is blockwise
from 256 tokens (`meshlm.job.auto_remat`, `meshlm.ops.kernels.DENSE_BELOW`). Both rest on this
measurement; re-run it on a new machine or JAX version before changing either.

Runs use the shapes and meshes of bench/maxtext_compare.py (one process per run: the device count is
fixed when JAX starts). Every variant is compiled first; then they are timed in rounds (--rounds, 4
steps of each variant per round, each step waited for), so all of them see the same load from other
jobs on a shared machine. A variant's figure is its median step. (Timing the variants one after the
other instead put whichever ran early up to 25% ahead on this machine.)

Usage: python bench/remat_cpu.py [--runs 1dev,1,8,1,1,2,2,2,1] [--rounds 5]
                                 [--variants none:dense,none:blockwise,save_qkv_attn:blockwise,full:blockwise]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from maxtext_compare import MESHLM_SETUP, RUNS, SHAPES  # noqa: E402

BASELINE = "none:dense"

ONE_RUN = (
    MESHLM_SETUP
    + r"""
import statistics
variants, rounds = last
built = {}
for variant in variants:
    remat, attention = variant.split(":")
    placement, state, step = build(remat=remat, attention=attention)
    source = batches(placement)
    state, metrics = step(state, next(source))  # compiles
    jax.block_until_ready(metrics)
    built[variant] = [state, step, source]
times = {variant: [] for variant in variants}
for _ in range(rounds):
    for variant, one in built.items():
        for _ in range(4):
            start = time.perf_counter()
            one[0], metrics = one[1](one[0], next(one[2]))
            jax.block_until_ready(metrics)
            times[variant].append(time.perf_counter() - start)
print("RESULT " + json.dumps({v: batch * seq / statistics.median(t) for v, t in times.items()}))
"""
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="1dev,1,8,1,1,2,2,2,1", help="runs of bench/maxtext_compare.py")
    ap.add_argument(
        "--variants",
        default="none:dense,none:blockwise,save_qkv_attn:dense,save_qkv_attn:blockwise,full:blockwise",
        help="REMAT:ATTENTION pairs, comma separated",
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds of 4 timed steps of every variant")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if BASELINE not in variants:
        variants.insert(0, BASELINE)
    for run in [r for r in RUNS if r in args.runs]:
        shape, devices, mesh = RUNS[run]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(
            JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
        )
        spec = json.dumps([*SHAPES[shape], ",".join(map(str, mesh)), [variants, args.rounds]])
        out = subprocess.run([sys.executable, "-c", ONE_RUN, spec], capture_output=True, text=True, env=env)
        found = re.search(r"^RESULT (.*)$", out.stdout, re.M)
        if out.returncode or not found:
            print(f"{run}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
            return 1
        rates = json.loads(found.group(1))
        base = rates[BASELINE]
        cells = "   ".join(f"{v} {r:,.0f} ({r / base:.2f}x)" for v, r in rates.items())
        print(f"{run:8s} tok/s, ratio to {BASELINE}:   {cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
