"""Accelerator benchmark: llama3-8b-shaped layers at T = 8192 in bfloat16 on the one device present.

Shape: `llama3-8b` with 8 layers (d_model 4096, 32 query / 8 kv heads of 128, mlp 14336, vocab 128256),
batch 1 x 8192 tokens, synthetic tokens, bfloat16 compute, float32 parameters, AdamW: one whole train
step (loss, gradients, update) per timing. Two runs in this process, one after the other (the device
holds one at a time):

1. the baseline kernel (`--baseline`, default blockwise: the pure-JAX kernel the CPU uses);
2. the backend's kernel (`--kernel`, default auto: splash on TPU, cuDNN on GPU, or Triton with
   `--packed`, whose rows hold two documents).

For each: median step time of --steps after --warmup, tokens/s, MFU = model FLOP/s (6 x non-embedding
params + causal attention, `meshlm.train.metrics.model_flops_per_token`) over the chip's peak
(`resolve_peak`: the datasheet table on GPU/TPU, a measured matmul on CPU). Then the kernel run's
ratio over the baseline, and the top ops of a `jax.profiler` trace of two steps of the kernel run.

    python bench/accelerator.py                      # on an H100 / TPU as is
    python bench/accelerator.py --small              # seconds on CPU: a smoke test of this script
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # one process owns the device

import argparse  # noqa: E402
import collections  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshlm.models.policy import RunPolicy
from meshlm.platform import configure_runtime  # noqa: E402  (imports no JAX)

configure_runtime()  # as `meshlm train` runs: the backend's XLA flag preset, the compilation cache

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import meshlm.models.decoder as llama  # noqa: E402
from meshlm.flops import model_flops_per_token  # noqa: E402
from meshlm.mesh import build_mesh, parse_mesh_dim  # noqa: E402
from meshlm.models.placement import place  # noqa: E402
from meshlm.models.presets import resolve_model  # noqa: E402
from meshlm.ops import kernels  # noqa: E402
from meshlm.optimizer import OptimizerConfig, make_optimizer  # noqa: E402
from meshlm.train.metrics import resolve_peak  # noqa: E402
from meshlm.train.state import TrainState, create_train_state, state_shardings  # noqa: E402
from meshlm.train.step import loss_sums  # noqa: E402

SMALL = dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, mlp_dim=256, vocab_size=512)
_ATTEND = llama.attend


def use_kernel(name: str) -> None:
    """Run the model's attention with kernel `name`. (Also bound here, not only in the config, so the
    choice holds whether or not `Attention` passes `policy.attention` on to `attend`.)"""
    llama.attend = functools.partial(_ATTEND, kernel=name)


def synthetic_batch(vocab: int, batch: int, seq: int, packed: bool) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    half = seq // 2
    positions = (
        np.arange(seq, dtype=np.int32) if not packed else np.concatenate([np.arange(half), np.arange(seq - half)])
    )
    return {
        "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
        "positions": np.tile(positions.astype(np.int32), (batch, 1)),
        "segment_ids": np.tile(np.repeat([1, 2], [half, seq - half]).astype(np.int32), (batch, 1)) if packed else None,
        "loss_mask": np.ones((batch, seq), np.float32),
    }  # fmt: skip


def make_step(placement, optimizer):
    """The train step on this batch: mean token loss, gradients, AdamW update (state donated)."""

    def step(state: TrainState, batch: dict):
        def loss(params):
            total, count = loss_sums(placement, params, batch)
            return total / count

        value, grads = jax.value_and_grad(loss)(state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state), value

    shardings = state_shardings(placement, optimizer)
    return jax.jit(step, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0)


def run(cfg, policy, kernel: str, args, profile_dir: str | None = None) -> dict:
    """Time --steps train steps with attention `kernel`; optionally trace two more into profile_dir."""
    use_kernel(kernel)
    mesh = build_mesh(parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1])
    placement = place(cfg, mesh, policy=policy.replace(attention=kernel))
    optimizer = make_optimizer(OptimizerConfig(total_steps=args.warmup + args.steps + 2))
    step = make_step(placement, optimizer)
    state = create_train_state(placement, optimizer, seed=0)
    batch = jax.device_put(synthetic_batch(cfg.vocab_size, args.batch, args.seq, args.packed), jax.devices()[0])
    t0 = time.perf_counter()
    memory = step.lower(state, batch).compile().memory_analysis()
    compile_s = time.perf_counter() - t0
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, loss = step(state, batch)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - t0)
    if profile_dir:
        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(2):
                state, loss = step(state, batch)
                loss.block_until_ready()
    stats = jax.devices()[0].memory_stats() or {}
    del state, step
    gc.collect()
    return {
        "step_s": statistics.median(times[args.warmup :]),
        "first_s": times[0],
        "compile_s": compile_s,
        "loss": (losses[0], losses[-1]),
        "temp_gib": getattr(memory, "temp_size_in_bytes", 0) / 2**30,
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
    }


def top_ops(profile_dir: str, n: int) -> list[tuple[str, float, float]]:
    """(op name, milliseconds, share) of the most expensive ops in the trace: the device's "XLA Ops"
    line on GPU/TPU, the XLA threads' op events on CPU (where a loop's span also holds its body's)."""
    path = sorted(Path(profile_dir).rglob("*.trace.json.gz"))[-1]
    with gzip.open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip

    def line(e) -> str:
        return threads.get((e.get("pid"), e.get("tid")), "")

    timed = [e for e in events if e.get("ph") == "X"]
    on_device = [e for e in timed if "/device:" in procs.get(e.get("pid"), "")]
    wrapper = ("ThunkExecutor", "end: ")  # CPU: the executor's own spans around the ops
    chosen = ([e for e in on_device if line(e) == "XLA Ops"] or on_device
              or [e for e in timed if "XLA" in line(e) and not e["name"].startswith(wrapper)])  # fmt: skip
    totals = collections.Counter()
    for e in chosen:
        totals[e["name"]] += e.get("dur", 0.0)
    whole = sum(totals.values()) or 1.0
    return [(name, us / 1e3, us / whole) for name, us in totals.most_common(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a tiny shape (2 layers, d_model 128, T 256): CPU smoke test")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 8192; 256 with --small)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kernel", default="auto", help="the kernel measured: auto, cudnn, triton, splash, ...")
    ap.add_argument("--baseline", default="blockwise", help="the kernel it is compared with (none: no baseline run)")
    ap.add_argument("--remat", default="none", help="remat policy of the layers")
    ap.add_argument("--loss_chunk", type=int, default=None, help="positions per loss chunk (default: the model's)")
    ap.add_argument(
        "--scan_unroll",
        type=int,
        default=0,
        help="layers per iteration of the layer loop (default 0: the model's auto, all of them on GPU)",
    )
    ap.add_argument("--packed", action="store_true", help="two documents per row (segment ids)")
    ap.add_argument("--top", type=int, default=12, help="ops listed from the profile")
    ap.add_argument("--trace_out", default=None, help="copy the kernel run's trace (.trace.json.gz) to this file")
    args = ap.parse_args(argv)
    args.seq = args.seq or (256 if args.small else 8192)
    if args.warmup < 1 or args.steps < 1:
        print("--warmup and --steps must be >= 1 (the first warm-up step compiles)", file=sys.stderr)
        return 2
    overrides = SMALL if args.small else {"n_layers": args.layers}
    cfg = resolve_model("llama3-8b", overrides).replace(max_seq_len=args.seq)
    policy = RunPolicy(dtype="bfloat16", remat=args.remat, scan_unroll=args.scan_unroll)
    if args.loss_chunk is not None:
        policy = policy.replace(loss_chunk=args.loss_chunk)
    device = jax.devices()[0]
    call = kernels.Call(platform=device.platform, q_len=args.seq, kv_len=args.seq, head_dim=cfg.head_dim,
                        dtype="bfloat16", packed=args.packed, causal=True,
                        gpu_capability=kernels.gpu_capability())  # fmt: skip
    try:
        chosen = [None if k == "none" else kernels.choose(k, call) for k in (args.baseline, args.kernel)]
    except Exception as e:  # a forced kernel that cannot serve this device: one line
        print(e, file=sys.stderr)
        return 2
    peak, source = resolve_peak(None, "bfloat16")
    flops_per_token = model_flops_per_token(cfg, args.seq)
    tokens = args.batch * args.seq
    print(
        f"{device.device_kind}: llama3-8b-shaped, {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.n_heads}/{cfg.n_kv_heads} heads x {cfg.head_dim}, mlp {cfg.mlp_dim}, vocab {cfg.vocab_size}; "
        f"{args.batch} x {args.seq} tokens{' (packed)' if args.packed else ''}, bf16, remat={args.remat}, "
        f"loss_chunk={policy.loss_chunk}, scan_unroll={policy.scan_unroll}"
    )
    print(f"peak {peak / 1e12:.1f} TFLOP/s ({source}); model {flops_per_token * tokens / 1e12:.2f} TFLOP/step")
    results = {}
    with tempfile.TemporaryDirectory() as profile_dir:
        for role, name in zip(("baseline", "kernel"), chosen):
            if name is None:
                continue
            r = run(cfg, policy, name, args, profile_dir if role == "kernel" else None)
            r["tokens_per_s"] = tokens / r["step_s"]
            r["mfu"] = flops_per_token * r["tokens_per_s"] / peak
            results[role] = r
            print(
                f"  {role:8s} {name:9s}: step {r['step_s'] * 1e3:8.1f} ms (median of {args.steps}; compile "
                f"{r['compile_s']:.1f} s, first {r['first_s']:.1f} s)  {r['tokens_per_s']:10,.0f} tok/s  MFU {r['mfu']:.3f}  "
                f"loss {r['loss'][0]:.3f}->{r['loss'][1]:.3f}  temp {r['temp_gib']:.1f} GiB  peak {r['peak_gib']:.1f} GiB"
            )
        if "baseline" in results:
            ratio = results["kernel"]["tokens_per_s"] / results["baseline"]["tokens_per_s"]
            print(f"{chosen[1]} / {chosen[0]} tokens/s: {ratio:.2f}x")
        if args.trace_out:
            shutil.copy(sorted(Path(profile_dir).rglob("*.trace.json.gz"))[-1], args.trace_out)
        print(f"top ops of 2 traced {chosen[1]} steps:")
        for name, ms, share in top_ops(profile_dir, args.top):
            print(f"  {ms:10.2f} ms  {share:6.1%}  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
