"""Benchmark local (sliding-window) attention: its cost grows linearly in T; every figure is a ratio
measured in this run.

Causal forward + backward, B=1, 4 query heads over 2 kv heads, D=64, float32, on CPU:

1. The blockwise kernel as the CPU dispatch runs it (`meshlm.ops.kernels.padded_blockwise`, blocks
   of at most 512) at a window of 1,024 for T = 4k, 8k, 16k, 32k: time per token stays flat when
   the cost is linear (target: 32k's per-token time within 1.5x of 4k's).
2. Global against local attention at T = 16k (target: local >= 5x faster).
3. RingAttention on sp=4 simulated devices at the same window, two lengths: CPU time per token
   (the simulated devices share this machine's cores, so CPU time is the work done).

Usage: python bench/local_attention.py [--quick]   (full: a few minutes on 2 quiet cores;
--quick: T up to 16k, no ring)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# bench.ring_attention sets 8 simulated CPU devices before JAX starts.
from bench.ring_attention import QKV_SPEC, SEQ_SPEC, fwd_bwd, measure, place, sp_mesh  # noqa: E402
from meshlm.ops.kernels import padded_blockwise  # noqa: E402
from meshlm.ops.ring import ring_attention  # noqa: E402

H, KVH, D, WINDOW = 4, 2, 64, 1024
assert os.environ["JAX_PLATFORMS"] == "cpu"


def inputs(t: int, seed: int = 0):
    """q, k, v, positions, an output cotangent for one row of t tokens."""
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((1, t, H, D), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, t, KVH, D), np.float32) for _ in range(2))
    return q, k, v, np.arange(t, dtype=np.int32)[None], dout


def blockwise_table(lengths, repeats: int) -> dict:
    """{(kind, T): (wall s, CPU s)}: local at every length, global at 16k."""
    variants = {("local", t): (fwd_bwd(padded_blockwise, window=WINDOW), inputs(t)) for t in lengths}
    variants[("global", 16384)] = (fwd_bwd(padded_blockwise), inputs(16384))
    return measure(variants, warmup=1, repeats=repeats)


def ring_table(lengths, repeats: int, sp: int = 4) -> dict:
    """{T: (wall s, CPU s)} of the ring on sp devices at the window, blocks of 512."""
    mesh = sp_mesh(sp)
    kw = dict(mesh=mesh, axis_name="sp", qkv_spec=QKV_SPEC, seq_spec=SEQ_SPEC, block_q=512, block_kv=512)
    specs = (QKV_SPEC, QKV_SPEC, QKV_SPEC, SEQ_SPEC, QKV_SPEC)
    variants = {t: (fwd_bwd(ring_attention, window=WINDOW, **kw), place(inputs(t), mesh, specs)) for t in lengths}
    return measure(variants, warmup=1, repeats=repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T up to 16k, no ring")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lengths = (4096, 8192, 16384) if args.quick else (4096, 8192, 16384, 32768)
    times = blockwise_table(lengths, args.repeats)
    print(f"blockwise, causal forward + backward, window {WINDOW}, H={H}/{KVH}, D={D}, float32 (medians)")
    print(f"{'attention':>10} {'T':>6} {'wall s':>8} {'CPU s':>8} {'us/token':>9}")
    for (kind, t), (wall, cpu) in times.items():
        print(f"{kind:>10} {t:>6} {wall:>8.3f} {cpu:>8.3f} {wall / t * 1e6:>9.1f}")
    first, last = lengths[0], lengths[-1]
    per_token = {t: times[("local", t)][0] / t for t in lengths}
    print(f"local per-token time, T={last} / T={first}: {per_token[last] / per_token[first]:.2f}x (linear: 1.0x)")
    ratio = times[("global", 16384)][0] / times[("local", 16384)][0]
    print(f"global / local at T=16384: {ratio:.1f}x (target >= 5x)")
    if args.quick:
        return
    ring = ring_table((8192, 16384), args.repeats)
    print("\nring, sp=4 simulated devices, same window (CPU time: the devices share the cores)")
    print(f"{'T':>6} {'wall s':>8} {'CPU s':>8} {'CPU us/token':>13}")
    for t, (wall, cpu) in ring.items():
        print(f"{t:>6} {wall:>8.3f} {cpu:>8.3f} {cpu / t * 1e6:>13.1f}")
    print(f"ring CPU per-token time, T=16384 / T=8192: {ring[16384][1] / 16384 / (ring[8192][1] / 8192):.2f}x")


if __name__ == "__main__":
    main()
