"""GPU attention kernels, forward + backward, at llama3-8b's attention shape (32 query / 8 kv heads of
128, T = 8192, bfloat16): blockwise (the pure-JAX kernel the CPU uses, the baseline), cuDNN, cuDNN over
packed documents, and the Pallas (Triton) kernel. Rows hold two documents for the kernels that mask
them. Prints the median time of --iters calls after warm-up, TFLOP/s of causal attention, and each
kernel's ratio over the baseline measured in the same run.

    python bench/gpu_attention.py              # on a GPU
    python bench/gpu_attention.py --small      # any backend: T = 512, the kernels that run there
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from meshlm.ops import gpu, kernels  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="T = 512: a smoke test on any backend")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    t = 512 if args.small else args.seq
    b, h, kvh, d = args.batch, 32, 8, 128
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kvh, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kvh, d), jnp.bfloat16)
    dout = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    half = t // 2
    seg = jnp.broadcast_to(jnp.repeat(jnp.array([1, 2], jnp.int32), jnp.array([half, t - half]),
                                      total_repeat_length=t), (b, t))  # fmt: skip
    pos2 = jnp.where(seg == 1, pos, pos - half)
    on_gpu = jax.default_backend() == "gpu"
    variants = {
        "blockwise": (lambda q, k, v: kernels.padded_blockwise(q, k, v, q_positions=pos, kv_positions=pos)),
        "blockwise packed": (
            lambda q, k, v: kernels.padded_blockwise(
                q, k, v, q_positions=pos2, kv_positions=pos2, q_segment_ids=seg, kv_segment_ids=seg
            )
        ),
    }
    if on_gpu:
        variants["cudnn"] = lambda q, k, v: gpu.cudnn_attention(q, k, v)
        for m in (2, 8, 32, 64):
            variants[f"cudnn packed M={m}"] = lambda q, k, v, m=m: gpu.cudnn_packed_attention(
                q, k, v, seg, max_segments=m
            )
        variants["triton packed"] = lambda q, k, v: gpu.triton_attention(q, k, v, seg)
    flops = 4 * b * t * t * h * d / 2 * 3.5  # causal: half the scores; backward 2.5x the forward
    print(f"{jax.devices()[0].device_kind}: attention fwd+bwd, B={b} T={t} heads {h}/{kvh} x {d}, bfloat16")
    base = None
    for name, fn in variants.items():
        step = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](dout))
        try:
            memory = step.lower(q, k, v).compile().memory_analysis()
            temp = getattr(memory, "temp_size_in_bytes", 0) / 2**30
            t0 = time.perf_counter()
            jax.block_until_ready(step(q, k, v))
            first = time.perf_counter() - t0
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                jax.block_until_ready(step(q, k, v))
                times.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001  (report the kernel that cannot run, go on with the rest)
            print(f"  {name:16s}: failed: {str(e).splitlines()[0][:150]}")
            continue
        ms = statistics.median(times) * 1e3
        base = base or ms
        print(
            f"  {name:16s}: {ms:8.2f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  {base / ms:6.2f}x blockwise"
            f"  temp {temp:6.2f} GiB  (compile+first {first:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
