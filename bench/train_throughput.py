"""Train-step throughput and MFU of the benchmark shape on 1 CPU device and on 8 simulated devices (FSDP).

Shape: `resolve_model("tiny")` (4 layers, d_model 256, 4 heads x 64, mlp 768, vocab 4096), seq 256,
global batch 8, synthetic random tokens, AdamW; float32 unless --dtype says otherwise.

Both runs happen in this process, after a matmul probe measured in the same run:

1. mesh 1,1,1,1 on one device (which uses every core of this machine);
2. mesh 1,8,1,1 (fsdp=8) on 8 simulated devices (`--xla_force_host_platform_device_count=8`, set
   below before JAX is imported), which share the same cores.

Each run does --warmup steps (the first compiles), then times --steps steps one by one (each waits
for its metrics) and reports the median; the timed steps of the two runs alternate, so that both
see the same load from other jobs, and the probe is measured just before and just after them.
MFU = model FLOP/s per device / peak per device, with model FLOPs from `model_flops_per_token`
(6 x non-embedding params + attention, causal halved) and the peak = the probe's FLOP/s divided by
the devices in the run: simulated devices split the machine, so MFU reads "share of this machine's
measured matmul rate" in both runs. (`resolve_peak` would divide the probe by
`jax.local_device_count()`, i.e. by 8 in this process even for the 1-device run, so the benchmark
divides by the devices of each run itself.)

Targets printed against: MFU >= 0.7 on one device; 8-device throughput >= 1-device throughput.

The CPU time of each step (all threads of this process) is printed too: on a machine shared with
other jobs it tracks the work done better than the wall clock.

Usage: python bench/train_throughput.py [--steps 5] [--warmup 2] [--dtype float32] [--remat none] [--json]
(about 1-2 minutes on 2 quiet cores; this machine is shared, so compare ratios, not times)
"""

from __future__ import annotations

import os

from meshlm.models.policy import RunPolicy
from meshlm.platform import simulated_device_flags  # imports no JAX

os.environ["XLA_FLAGS"] = simulated_device_flags(os.environ.get("XLA_FLAGS", ""), 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshlm.errors import UsageError  # noqa: E402
from meshlm.flops import matmul_probe, model_flops_per_token  # noqa: E402
from meshlm.mesh import build_mesh, parse_mesh_dim  # noqa: E402
from meshlm.models.decoder import REMAT_POLICIES  # noqa: E402
from meshlm.models.placement import place  # noqa: E402
from meshlm.models.presets import resolve_model  # noqa: E402
from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer  # noqa: E402
from meshlm.train.state import create_train_state  # noqa: E402
from meshlm.train.step import make_train_step, put_batch  # noqa: E402

SEQ_LEN, GLOBAL_BATCH = 256, 8
TARGET_MFU_1DEV = 0.7
TARGET_RATIO_8DEV = 1.0


def synthetic_batch(vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (GLOBAL_BATCH, SEQ_LEN + 1)).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.tile(np.arange(SEQ_LEN, dtype=np.int32), (GLOBAL_BATCH, 1)),
        "segment_ids": np.ones((GLOBAL_BATCH, SEQ_LEN), np.int32),
        "loss_mask": np.ones((GLOBAL_BATCH, SEQ_LEN), np.float32),
    }


def prepare(cfg, policy, mesh_dim: str, n_devices: int, total_steps: int) -> dict:
    """Build, compile and run the first step on `mesh_dim` over the first `n_devices` devices."""
    shape = parse_mesh_dim(mesh_dim, n_devices)
    mesh = build_mesh(shape, jax.devices()[:n_devices])
    placement = place(cfg, mesh, policy=policy)
    opt_cfg = OptimizerConfig(total_steps=total_steps)
    optimizer = make_optimizer(opt_cfg)
    step = make_train_step(placement, optimizer, lr_schedule(opt_cfg))
    run = {"mesh_dim": str(shape), "devices": n_devices, "times": [], "cpu": [], "losses": []}
    run["state"] = create_train_state(placement, optimizer, seed=0)
    batch = put_batch(placement, synthetic_batch(cfg.vocab_size))

    def one_step() -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        run["state"], metrics = step(run["state"], batch)
        run["losses"].append(float(jax.device_get(metrics["loss"])))  # waits for the step
        run["times"].append(time.perf_counter() - t0)
        run["cpu"].append(time.process_time() - c0)

    one_step()
    run["first_step_s"] = run["times"][0]  # compile + one step
    run["step"] = one_step
    return run


def summarize(run: dict, warmup: int) -> dict:
    times, cpu, losses = run["times"][warmup:], run["cpu"][warmup:], run["losses"]
    return {
        "mesh_dim": run["mesh_dim"],
        "devices": run["devices"],
        "first_step_s": run["first_step_s"],
        "step_s_median": statistics.median(times),
        "step_s_all": times,
        "cpu_s_median": statistics.median(cpu),  # CPU seconds of this process per step: its total work
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def print_report(result: dict, cfg, args) -> None:
    """The text form of `main`'s result: the model, the probe, each run and the two targets."""
    runs, ratio, probe = result["runs"], result["ratio_8dev_over_1dev"], result["probe_gflops"]
    one = runs[0]
    print(
        f"tiny: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads}x{cfg.head_dim} heads, mlp {cfg.mlp_dim}, "
        f"vocab {cfg.vocab_size}; seq {SEQ_LEN} x batch {GLOBAL_BATCH}; {args.dtype}, remat={args.remat}"
    )
    print(
        f"model FLOPs/step {result['model_gflop_per_step']:.1f} G; matmul probe {probe['used']:.1f} GFLOP/s "
        f"(before {probe['before']:.1f}, after {probe['after']:.1f}; best used)"
    )
    for r in runs:
        print(
            f"  mesh {r['mesh_dim']} on {r['devices']} device(s): step {r['step_s_median'] * 1e3:7.0f} ms (median of "
            f"{args.steps}, CPU {r['cpu_s_median'] * 1e3:.0f} ms; compile+first {r['first_step_s']:.1f} s)  "
            f"{r['tokens_per_s']:8,.0f} tok/s  "
            f"{r['model_tflops_per_s'] * 1e3:6.1f} GFLOP/s  MFU {r['mfu']:.2f} (peak/device "
            f"{r['peak_flops_per_device'] / 1e9:.1f} GFLOP/s)  loss {r['loss_first']:.3f}->{r['loss_last']:.3f}"
        )
    t = result["targets"]
    print(
        f"MFU on 1 device: {one['mfu']:.2f} (target >= {TARGET_MFU_1DEV}: "
        f"{'met' if t['mfu_1dev']['met'] else 'NOT met'})"
    )
    print(
        f"8-device / 1-device throughput: {ratio:.2f}x (target >= {TARGET_RATIO_8DEV:.1f}: "
        f"{'met' if t['ratio_8dev']['met'] else 'NOT met'})"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    ap.add_argument("--dtype", default="float32", help="compute dtype (float32 is the CPU default)")
    ap.add_argument("--remat", default="none", help="remat policy: none, save_dots, save_attn, save_qkv_attn, full")
    ap.add_argument("--mesh_dim", default="1,8,1,1", help="mesh of the 8-device run")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        print("--steps and --warmup must be >= 1 (the first warm-up step compiles)", file=sys.stderr)
        return 2
    if jax.device_count() < 8:
        print(
            f"need 8 CPU devices, have {jax.device_count()}: was JAX imported before XLA_FLAGS was set?",
            file=sys.stderr,
        )
        return 2

    try:
        if args.remat not in REMAT_POLICIES:
            raise UsageError(f"--remat={args.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        try:
            jax.numpy.dtype(args.dtype)
        except TypeError:
            raise UsageError(f"--dtype={args.dtype!r} is not a dtype; use float32 or bfloat16") from None
        parse_mesh_dim(args.mesh_dim, 8)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    cfg, policy = resolve_model("tiny"), RunPolicy(dtype=args.dtype, remat=args.remat)
    flops_per_step = model_flops_per_token(cfg, SEQ_LEN) * GLOBAL_BATCH * SEQ_LEN
    tokens = GLOBAL_BATCH * SEQ_LEN

    total = args.warmup + args.steps
    prepared = [prepare(cfg, policy, "1,1,1,1", 1, total), prepare(cfg, policy, args.mesh_dim, 8, total)]
    for _ in range(args.warmup - 1):
        for r in prepared:
            r["step"]()
    probe_before = matmul_probe(args.dtype)  # FLOP/s of the whole machine (one device uses every core)
    for _ in range(args.steps):  # alternate the two runs, so that both see the same load from other jobs
        for r in prepared:
            r["step"]()
    probe_after = matmul_probe(args.dtype)
    probe = max(probe_before, probe_after)  # the one less disturbed by other jobs
    runs = [summarize(r, args.warmup) for r in prepared]

    for r in runs:
        r["tokens_per_s"] = tokens / r["step_s_median"]
        r["model_tflops_per_s"] = flops_per_step / r["step_s_median"] / 1e12
        r["peak_flops_per_device"] = probe / r["devices"]
        r["mfu"] = (flops_per_step / r["step_s_median"] / r["devices"]) / r["peak_flops_per_device"]
    one, eight = runs
    ratio = eight["tokens_per_s"] / one["tokens_per_s"]
    result = {
        "model": "tiny",
        "seq_len": SEQ_LEN,
        "global_batch": GLOBAL_BATCH,
        "dtype": args.dtype,
        "remat": args.remat,
        "model_gflop_per_step": flops_per_step / 1e9,
        "probe_gflops": {"before": probe_before / 1e9, "after": probe_after / 1e9, "used": probe / 1e9},
        "runs": runs,
        "ratio_8dev_over_1dev": ratio,
        "targets": {
            "mfu_1dev": {"target": TARGET_MFU_1DEV, "value": one["mfu"], "met": one["mfu"] >= TARGET_MFU_1DEV},
            "ratio_8dev": {"target": TARGET_RATIO_8DEV, "value": ratio, "met": ratio >= TARGET_RATIO_8DEV},
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result, cfg, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
