"""How well `meshlm plan` predicts: memory and collectives against the compiler, ranking against the clock.

Part 1, the accuracy grid (the 12 cases of `tests/plan/test_accuracy.py`; model, mesh, remat,
batch, seq_len, grad_accum on 8 simulated CPU devices): each case's train step is compiled with
abstract inputs, and the predicted per-device peak memory and collective bytes per step are
compared with `compiled.memory_analysis()` and the collectives of the compiled HLO. Prints each
case, then the median and the worst error of each.

Part 2, the ranking: one small job (--model, --batch_size, --seq_len on 8 simulated CPU devices,
float32) is planned with `--hardware=cpu` (the probe measures this machine), then the real train
step of every candidate mesh is run and timed. The timed steps go round-robin over the meshes
(one step of each mesh per round), so all see the same load from other jobs on this shared
machine; each mesh's time is its median (and, less sensitive to other jobs' bursts, its best).
Prints each mesh's measured time as a ratio to the fastest measured in this run, whether the mesh
`plan` ranks first is within 10% of it and of the fastest among the plan's top 5, and the rank
correlation of predicted and measured times. --save F.json keeps each mesh's predicted and measured
times, its collective count and the probes' figures, to check a change to the model against them.

Usage: python bench/plan_accuracy.py [--model tiny] [--batch_size 8] [--seq_len 128] [--rounds 7] [--skip_grid]
       [--save F.json]
(a few minutes on 2 cores: 12 + ~19 compiles and the timed steps)
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
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

from meshlm.explain.verify import compile_step, error_percent, measure  # noqa: E402
from meshlm.mesh import build_mesh, parse_mesh_dim  # noqa: E402
from meshlm.models.placement import place  # noqa: E402
from meshlm.models.policy import RunPolicy  # noqa: E402
from meshlm.models.presets import resolve_model  # noqa: E402
from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer  # noqa: E402
from meshlm.plan import comms, memory, search  # noqa: E402
from meshlm.plan.hardware import resolve_hardware  # noqa: E402
from meshlm.plan.job import Job  # noqa: E402
from meshlm.train.state import create_train_state  # noqa: E402
from meshlm.train.step import make_train_step, put_batch, sequence_permutation  # noqa: E402
from tests.plan.test_accuracy import CASES, IDS, job_for  # noqa: E402


def grid() -> None:
    print(f"1. accuracy grid: {len(CASES)} cases on 8 simulated CPU devices (error = predicted vs compiled)")
    print(
        f"   {'case':40s} {'peak MB':>9s} {'compiled':>9s} {'error':>7s}   {'coll MB':>8s} {'compiled':>9s} {'error':>7s}"
    )
    mem_err, coll_err = [], []
    for case, name in zip(CASES, IDS):
        overrides, mesh_dim, batch, seq, remat, accum = case
        job = job_for(overrides, batch, seq, remat, accum)
        shape = parse_mesh_dim(mesh_dim, 8)
        got = measure(compile_step(job, shape, jax.devices()[:8]))
        peak, coll = memory.estimate(job, shape).total, comms.total_bytes(comms.predict(job, shape))["total"]
        m = error_percent(peak, got["peak_memory_bytes"])
        c = error_percent(coll, got["collective_bytes"]["total"])
        mem_err.append(m)
        coll_err.append(c)
        print(
            f"   {name:40s} {peak / 1e6:9.3f} {got['peak_memory_bytes'] / 1e6:9.3f} {m:+6.1f}%   "
            f"{coll / 1e6:8.3f} {got['collective_bytes']['total'] / 1e6:9.3f} {c:+6.1f}%",
            flush=True,
        )
    for what, errs, bound in (
        ("peak memory", mem_err, "target -3% .. +10%"),
        ("collective bytes", coll_err, "target ±5%"),
    ):
        worst = max(errs, key=abs)
        print(
            f"   {what:16s}: median |error| {statistics.median(abs(e) for e in errs):.1f}%, "
            f"worst {worst:+.1f}% (range {min(errs):+.1f}% .. {max(errs):+.1f}%; {bound})"
        )


def synthetic_batch(cfg, rows: int, seq: int) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (rows, seq + 1), dtype=np.int32)
    return dict(
        inputs=tokens[:, :-1],
        targets=tokens[:, 1:],
        positions=np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
        segment_ids=np.ones((rows, seq), np.int32),
        loss_mask=np.ones((rows, seq), np.float32),
    )


def ranking(model: str, batch: int, seq: int, rounds: int, save: str | None = None) -> None:
    cfg, policy = resolve_model(model, {}), RunPolicy(dtype="float32")
    job = Job(cfg, batch, seq, 8, policy=policy)
    hw = resolve_hardware("cpu", 8, "float32")
    plans, _ = search.search(job, hw)
    print(
        f"\n2. ranking: --model={model} --batch_size={batch} --seq_len={seq}, float32, 8 simulated CPU devices; "
        f"{len(plans)} candidate meshes"
    )
    print(
        f"   probe: {hw.peak_fp32 * 8 / 1e9:.1f} GFLOP/s matmul, {hw.fast_bandwidth * 8 / 1e9:.1f} GB/s copy (whole machine), "
        f"{hw.collective_latency * 1e6:.0f} µs per collective, {hw.ring_step_s * 1e3:.2f} ms per ring step; "
        "matmul efficiency by rows per device: " + ", ".join(f"{r}: {e:.2f}" for r, e in hw.matmul_rows)
    )
    optimizer = make_optimizer(OptimizerConfig())
    host = synthetic_batch(cfg, batch, seq)
    runs = []
    for plan in plans:
        placement = place(cfg, build_mesh(plan.shape, jax.devices()[:8]), policy=policy)
        state = create_train_state(placement, optimizer, seed=0)
        step = make_train_step(placement, optimizer, lr_schedule(OptimizerConfig()))
        data = put_batch(placement, host, sequence_permutation(placement, seq))
        for _ in range(2):  # compile, then one warm step
            state, metrics = step(state, data)
            jax.block_until_ready(metrics)
        runs.append({"plan": plan, "state": state, "step": step, "data": data, "times": []})
    for _ in range(rounds):
        for run in runs:
            t0 = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], run["data"])
            jax.block_until_ready(metrics)
            run["times"].append(time.perf_counter() - t0)
    for run in runs:
        run["measured"], run["best"] = statistics.median(run["times"]), min(run["times"])
    fastest = min(runs, key=lambda r: r["measured"])
    fastest_best = min(r["best"] for r in runs)
    print(
        f"   {'plan rank':>9s} {'mesh_dim':9s} {'predicted s':>11s} {'median s':>9s} {'/ fastest':>9s} "
        f"{'best s':>7s} {'/ fastest':>9s}"
    )
    for rank, run in enumerate(runs, 1):
        print(
            f"   {rank:9d} {run['plan'].mesh_dim:9s} {run['plan'].time.step_s:11.4f} {run['measured']:9.4f} "
            f"{run['measured'] / fastest['measured']:9.3f} {run['best']:7.4f} {run['best'] / fastest_best:9.3f}"
        )
    first = runs[0]
    ratio = first["measured"] / fastest["measured"]
    measured_rank = sorted(runs, key=lambda r: r["measured"]).index(first) + 1
    print(
        f"   plan's first choice --mesh_dim={first['plan'].mesh_dim}: median step {ratio:.3f} x the fastest measured "
        f"(--mesh_dim={fastest['plan'].mesh_dim}), measured rank {measured_rank} of {len(runs)}: "
        f"{'within' if ratio <= 1.10 else 'NOT within'} 10%; best step {first['best'] / fastest_best:.3f} x the fastest best"
    )
    top = runs[:5]
    fastest_top = min(top, key=lambda r: r["measured"])
    top_ratio = first["measured"] / fastest_top["measured"]
    print(
        f"   among the plan's top {len(top)}: the first choice's median step is {top_ratio:.3f} x the fastest of them "
        f"(--mesh_dim={fastest_top['plan'].mesh_dim}): {'within' if top_ratio <= 1.10 else 'NOT within'} 10%"
    )
    print(
        f"   rank correlation of predicted and measured step times: "
        f"{rank_correlation([r['plan'].time.step_s for r in runs], [r['measured'] for r in runs]):.2f}; "
        f"slowest / fastest measured: {max(r['measured'] for r in runs) / fastest['measured']:.2f}, "
        f"predicted: {runs[-1]['plan'].time.step_s / runs[0]['plan'].time.step_s:.2f}"
    )
    if save:
        rows = [
            dict(
                mesh_dim=r["plan"].mesh_dim,
                remat=r["plan"].job.policy.remat,
                predicted_s=r["plan"].time.step_s,
                compute_s=r["plan"].time.compute_s,
                comm_s=r["plan"].time.comm_s,
                collectives=sum(c.count for c in r["plan"].collectives),
                serial_collectives=sum(c.count for c in r["plan"].collectives if not c.overlappable),
                measured_s=r["measured"],
                best_s=r["best"],
                times=r["times"],
            )
            for r in runs
        ]
        Path(save).write_text(
            json.dumps(
                dict(
                    model=model,
                    batch_size=batch,
                    seq_len=seq,
                    hardware=dict(
                        peak=hw.peak_fp32,
                        copy=hw.fast_bandwidth,
                        latency=hw.collective_latency,
                        ring_step=hw.ring_step_s,
                        matmul_rows=hw.matmul_rows,
                    ),
                    plans=rows,
                ),
                indent=1,
            )
        )
        print(f"   saved to {save}")


def rank_correlation(a: list[float], b: list[float]) -> float:
    """Spearman's rho (no ties expected among step times)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7, help="timed steps per mesh (round-robin)")
    p.add_argument("--skip_grid", action="store_true")
    p.add_argument("--save", help="write each mesh's predicted and measured step times to this JSON file")
    args = p.parse_args()
    if not args.skip_grid:
        grid()
    ranking(args.model, args.batch_size, args.seq_len, args.rounds, args.save)


if __name__ == "__main__":
    main()
