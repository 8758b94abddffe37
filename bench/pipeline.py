"""Pipeline bubble, measured: pp = 4 on 4 simulated CPU devices, each schedule, M in {4, 8, 16}.

A microbatch is a fixed number of rows (--rows), so the batch grows with M. For each schedule the
step time t(M) is measured (the fastest of --steps steps: the machine is shared, and the minimum is
the least disturbed) and fitted by least squares over the three M as t = a + s·M: s is the cost of
one more microbatch in the steady state, a what the step costs besides. The same model without a
pipeline on the same devices (mesh 1,4,1,1, fsdp) and the same batches gives a0, the per-step cost
that is not microbatch work in either (the optimizer update, the step's launch; taken as 0 when the
fit gives less, which happens when the baseline's time grows faster than M). The fill and drain
of the pipeline is then a - a0, and the measured bubble its share of the microbatch work:

    bubble(M) = (a - a0) / (t(M) - a0),

printed next to the theory, (p - 1)/(m·v + p - 1) (v = 1 for gpipe and 1f1b, v = --virtual for
interleaved), with their ratio (target: within 1.3×).

On simulated devices the ranks share this machine's cores: a rank with nothing to do in a clock
still computes (on its trash slot, thrown away), so the bubble shows as wasted compute, with the
same share of the step as idle time would have on real devices.

Usage: python bench/pipeline.py [--steps 7] [--rows 4] [--seq 128] [--layers 8] [--virtual 2]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=4"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshlm.mesh import build_mesh, parse_mesh_dim  # noqa: E402
from meshlm.models.placement import place  # noqa: E402
from meshlm.models.policy import RunPolicy  # noqa: E402
from meshlm.models.presets import resolve_model  # noqa: E402
from meshlm.ops.pipeline import build_schedule  # noqa: E402
from meshlm.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from meshlm.train.state import create_train_state  # noqa: E402
from meshlm.train.step import make_train_step, put_batch  # noqa: E402

PP = 4
MS = (4, 8, 16)


def batch(rows: int, seq: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "inputs": rng.integers(0, vocab, (rows, seq), dtype=np.int32),
        "targets": rng.integers(0, vocab, (rows, seq), dtype=np.int32),
        "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
        "segment_ids": np.ones((rows, seq), np.int32),
        "loss_mask": np.ones((rows, seq), np.float32),
    }


def step_time(cfg, mesh_dim: str, pp: int, schedule, rows: int, seq: int, steps: int) -> float:
    mesh = build_mesh(parse_mesh_dim(mesh_dim, 4, pp=pp))
    placement = place(cfg, mesh, policy=RunPolicy(dtype="float32"))
    optimizer = make_optimizer(OptimizerConfig(lr=1e-3))
    state = create_train_state(placement, optimizer, 0)
    step = make_train_step(placement, optimizer, pipeline=schedule)
    b = put_batch(placement, batch(rows, seq, cfg.vocab_size))
    state, m = step(state, b)  # compile
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, b)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2)
    args = ap.parse_args()
    cfg = resolve_model("test", {"n_layers": str(args.layers), "d_model": "128", "mlp_dim": "256"})
    print(
        f"model: test preset, {args.layers} layers, d_model 128; pp={PP} on 4 simulated CPU devices; "
        f"{args.rows} rows × {args.seq} tokens per microbatch; fastest of {args.steps} steps"
    )
    plain = {M: step_time(cfg, "1,4,1,1", 1, None, M * args.rows, args.seq, args.steps) for M in MS}
    s0, fit = np.polyfit(MS, [plain[M] for M in MS], 1)
    a0 = max(fit, 0.0)  # a fixed cost is not negative: a negative intercept is the baseline growing faster than M
    print(
        "no pipeline (1,4,1,1): "
        + ", ".join(f"M={M} {plain[M]:.3f} s" for M in MS)
        + f"; per-step cost besides microbatches a0 = {a0:.3f} s (fit {fit:.3f} s)"
    )
    print(f"{'schedule':<18}{'M':>4}{'step s':>9}{'no-pp s':>9}{'pp/no-pp':>10}{'bubble':>9}{'theory':>9}{'ratio':>7}")
    for name in ("gpipe", "1f1b", "interleaved"):
        v = args.virtual if name == "interleaved" else 1
        t = {
            M: step_time(cfg, "1,1,1,1", PP, build_schedule(name, PP, M, v), M * args.rows, args.seq, args.steps)
            for M in MS
        }
        s, a = np.polyfit(MS, [t[M] for M in MS], 1)
        for M in MS:
            measured = (a - a0) / (t[M] - a0)
            theory = build_schedule(name, PP, M, v).theoretical_bubble()
            ratio = measured / theory if theory else float("nan")
            print(
                f"{name + (f'(v={v})' if v > 1 else ''):<18}{M:>4}{t[M]:>9.3f}{plain[M]:>9.3f}"
                f"{t[M] / plain[M]:>10.2f}{measured:>9.1%}{theory:>9.1%}{ratio:>7.2f}"
            )


if __name__ == "__main__":
    main()
