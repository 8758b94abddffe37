"""Benchmark RingAttention on 8 simulated CPU devices; every figure is a ratio measured in this run.

Causal forward + backward, B=1, H=8 query heads, D=64, float32, both kernels with the same
block size:

1. Ring overhead: the ring on sp=4 vs the blockwise kernel on one device at the same T
   (target: ring <= 1.25x). Measured in CPU time, i.e. total work: the simulated devices share
   this machine's cores (and one device's program runs on one core), so the ring's wall clock
   says little about its cost. The wall-clock ratio is printed alongside.
2. Load balancing: the ring on sp=4 with the zigzag token order vs the same ring on the
   contiguous order (target: balanced >= 1.5x faster). On real devices the ring runs in
   lockstep and each step lasts as long as its busiest device; on shared cores wall-clock
   time follows the *total* work instead, which balancing does not change (skipped blocks are
   skipped either way). So the benchmark measures the critical path: it times, on one device,
   the step (forward_chunk + backward_chunk) of every rank at every ring step, and sums over
   steps the busiest rank's time. The wall-clock ratio on this machine is printed alongside.
3. Memory scaling: the largest T whose forward + backward compiles under a fixed per-device
   memory budget (arguments + outputs + temporaries of `compiled.memory_analysis()`), for
   sp = 1, 2, 4, 8 (target: grows at least linearly with sp), for MHA and for GQA.

Usage: python bench/ring_attention.py [--quick]   (full: about 5 minutes on 2 quiet cores)
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshlm.ops import attention as attn  # noqa: E402
from meshlm.ops.attention import blockwise_attention  # noqa: E402
from meshlm.ops.ring import ring_attention, ring_block_size, zigzag_permutation  # noqa: E402

B, H, D = 1, 8, 64
QKV_SPEC, SEQ_SPEC = P(None, "sp", None, None), P(None, "sp")


def measure(variants: dict, warmup: int, repeats: int, summary=statistics.median) -> dict:
    """{name: (fn, args)} -> {name: (wall seconds, CPU seconds)} of `fn(*args)`, each the
    `summary` (by default the median) of `repeats` timed runs.

    Each variant runs `warmup` times first (the first run compiles); the timed runs then
    alternate between variants, so a change in the machine's load hits all of them alike. CPU
    time is this process's, summed over its threads: the work done, whatever else the machine
    is running.
    """
    for fn, args in variants.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (fn, args) in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args))
            samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (summary([w for w, _ in runs]), summary([c for _, c in runs])) for name, runs in samples.items()}


def fwd_bwd(attention, **kw):
    """jit of q, k, v, positions, dout -> (dq, dk, dv) of a causal attention function."""

    def loss(q, k, v, pos, dout):
        out = attention(q, k, v, q_positions=pos, kv_positions=pos, causal=True, **kw)
        return jnp.sum(out * dout)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def sp_mesh(sp: int):
    return jax.make_mesh((sp,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:sp])


def ring_fwd_bwd(sp: int, block: int):
    kw = dict(mesh=sp_mesh(sp), axis_name="sp", qkv_spec=QKV_SPEC, seq_spec=SEQ_SPEC)
    return fwd_bwd(ring_attention, **kw, block_q=block, block_kv=block)


def inputs(t: int, kvh: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((B, t, H, D), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, t, kvh, D), np.float32) for _ in range(2))
    pos = np.arange(t, dtype=np.int32)[None]
    return q, k, v, pos, dout


def place(arrays, mesh, specs):
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]


# --------------------------------------------------------------------------------------------
# 1 + 2: time
# --------------------------------------------------------------------------------------------


def critical_path(t: int, sp: int, block: int, kvh: int, warmup: int, repeats: int, summary=statistics.median) -> dict:
    """{order: sum over ring steps of the busiest rank's step time} (CPU seconds).

    Step `s` on rank `r` is what the ring computes there: `forward_chunk` then `backward_chunk`
    of r's query shard against the key shard of rank r - s, with the ring's block size (so the
    same blocks are skipped). Each (rank, step) is timed on its own, on one device.
    """
    blocks = dict(causal=True, block_q=block, block_kv=block)

    @jax.jit
    def ring_step(q, k, v, q_pos, kv_pos, dout):
        q = attn.group_queries(q, k.shape[2])
        state = attn.forward_chunk(attn.init_state(q), q, k, v, q_pos, kv_pos, None, None, **blocks)
        lse = delta = jnp.zeros_like(state.l)  # stand-ins: the time does not depend on the values
        zeros = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
        dout = attn.group_queries(dout, k.shape[2])
        grads = attn.backward_chunk(zeros, q, k, v, q_pos, kv_pos, None, None, dout, lse, delta, **blocks)
        return state, grads

    q, k, v, pos, dout = inputs(t, kvh)
    variants = {}
    for order in ("contiguous", "zigzag"):
        perm = zigzag_permutation(t, sp) if order == "zigzag" else np.arange(t)

        def shard(x, rank, perm=perm):  # rank's contiguous slice of the (reordered) sequence
            local = x[:, perm].reshape(B, sp, t // sp, *x.shape[2:])[:, rank]
            return jax.device_put(local, jax.devices()[0])

        for r in range(sp):
            for s in range(sp):
                j = (r - s) % sp  # the key shard rank r holds at step s
                args = (shard(q, r), shard(k, j), shard(v, j), shard(pos, r), shard(pos, j), shard(dout, r))
                variants[order, r, s] = (ring_step, args)
    cpu = {key: c for key, (_, c) in measure(variants, warmup, repeats, summary).items()}
    return {
        order: sum(max(cpu[order, r, s] for r in range(sp)) for s in range(sp)) for order in ("contiguous", "zigzag")
    }


def time_section(lengths, sp: int, kvh: int, block: int, warmup: int, repeats: int) -> None:
    print(
        f"\n== time: causal forward + backward, B={B} H={H} KVH={kvh} D={D} fp32, ring on sp={sp}, blocks of {block} =="
    )
    header = (
        f"{'T':>6} | {'blockwise, 1 device':>19} | {'ring / blockwise':>16} | {'(wall)':>6} | "
        f"{'unbalanced / balanced':>21} | {'(wall)':>6}"
    )
    print(header)
    print("-" * len(header))
    for t in lengths:
        ring_block = ring_block_size(block, t // sp, causal=True)
        q, k, v, pos, dout = inputs(t, kvh)
        mesh, specs = sp_mesh(sp), (QKV_SPEC, QKV_SPEC, QKV_SPEC, SEQ_SPEC, QKV_SPEC)
        one_device = [jax.device_put(x, jax.devices()[0]) for x in (q, k, v, pos, dout)]
        variants = {"blockwise": (fwd_bwd(blockwise_attention, block_q=block, block_kv=block), one_device)}
        for order in ("contiguous", "zigzag"):
            perm = zigzag_permutation(t, sp) if order == "zigzag" else np.arange(t)
            args = place([x[:, perm] for x in (q, k, v, pos, dout)], mesh, specs)
            variants[order] = (ring_fwd_bwd(sp, ring_block), args)
        res = measure(variants, warmup, repeats)
        (base_wall, base_cpu), (zz_wall, zz_cpu) = res["blockwise"], res["zigzag"]
        path = critical_path(t, sp, ring_block, kvh, warmup=1, repeats=repeats)
        print(
            f"{t:>6} | {f'1.00x ({base_cpu:.2f} s CPU)':>19} | {zz_cpu / base_cpu:>15.2f}x | "
            f"{zz_wall / base_wall:>5.2f}x | {path['contiguous'] / path['zigzag']:>20.2f}x | "
            f"{res['contiguous'][0] / zz_wall:>5.2f}x"
        )
    print(
        "ring / blockwise: CPU time (total work) of the ring, zigzag order, vs the blockwise kernel"
        " on one device (target <= 1.25x).\n"
        "unbalanced / balanced: critical path (sum over steps of the busiest rank's measured step"
        " time, as on dedicated devices running in lockstep) of the contiguous vs the zigzag"
        " order (target >= 1.5x).\n"
        "(wall): the same ratios in wall-clock time of the whole ring on this machine, where the"
        " simulated devices share the cores (and the single device uses one core)."
    )


# --------------------------------------------------------------------------------------------
# 3: memory
# --------------------------------------------------------------------------------------------


def ring_bytes(sp: int, t: int, kvh: int, block: int) -> int:
    """Per-device bytes of the compiled ring forward + backward (compiled, never run)."""
    mesh = sp_mesh(sp)
    qkv = NamedSharding(mesh, QKV_SPEC)
    x = jax.ShapeDtypeStruct((B, t, H, D), jnp.float32, sharding=qkv)
    kv = jax.ShapeDtypeStruct((B, t, kvh, D), jnp.float32, sharding=qkv)
    pos = jax.ShapeDtypeStruct((B, t), jnp.int32, sharding=NamedSharding(mesh, SEQ_SPEC))
    stats = ring_fwd_bwd(sp, block).lower(x, kv, kv, pos, x).compile().memory_analysis()
    return (
        stats.argument_size_in_bytes + stats.output_size_in_bytes
        + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    )  # fmt: skip


def max_length(sp: int, kvh: int, budget: int, block: int) -> int:
    """Largest T (a multiple of 2 * sp * block) whose forward + backward fits the budget.

    Memory is affine in T for a fixed sp, so two compiles give a first guess; compiles at the
    guess and one step beyond then confirm it is the largest that fits.
    """
    unit = 2 * sp * block
    fits = lambda m: ring_bytes(sp, m * unit, kvh, block) <= budget  # noqa: E731
    m1, m2 = 4, 8
    b1, b2 = ring_bytes(sp, m1 * unit, kvh, block), ring_bytes(sp, m2 * unit, kvh, block)
    per_unit = (b2 - b1) / (m2 - m1)
    m = max(1, int((budget - b1) / per_unit) + m1)
    while m > 1 and not fits(m):
        m -= 1
    while fits(m + 1):
        m += 1
    return m * unit


def memory_section(kvh: int, budget_mib: int, block: int) -> None:
    budget = budget_mib * 2**20
    print(f"\n== memory: largest T under {budget_mib} MiB per device, H={H} KVH={kvh} D={D} fp32 ==")
    print(f"{'sp':>3} | {'max T':>7} | {'max T / max T(sp=1)':>19} | {'vs sp x max T(sp=1)':>19}")
    base = None
    for sp in (1, 2, 4, 8):
        t = max_length(sp, kvh, budget, block)
        base = base or t
        print(f"{sp:>3} | {t:>7} | {t / base:>18.2f}x | {t / (sp * base):>18.2f}x")
    print("target: max T grows at least linearly with sp (last column >= 1).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=4096 only, fewer repeats")
    parser.add_argument("--sp", type=int, default=4)
    parser.add_argument("--block", type=int, default=256, help="block size of both kernels")
    parser.add_argument("--budget_mib", type=int, default=None)
    args = parser.parse_args()
    lengths = (4096,) if args.quick else (4096, 8192)
    warmup, repeats = (1, 3) if args.quick else (2, 3)
    start = time.perf_counter()
    print(f"{jax.device_count()} simulated {jax.devices()[0].platform} devices, {os.cpu_count()} cores")
    time_section(lengths, args.sp, kvh=H, block=args.block, warmup=warmup, repeats=repeats)
    budget = args.budget_mib or (64 if args.quick else 256)
    for kvh in (H, 2):
        memory_section(kvh, budget, block=128)
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
