"""Data loading against the train step: `DataLoader.batch` time and the wait for a prefetched batch,
each as a fraction of the step time of the same shape, measured in the same run.

A corpus of random words is generated (--mb of text, JSONL), a byte-level BPE of the tiny model's
vocabulary is trained on it and the corpus tokenized into memory-mapped shards (`prepare_tokens`,
under a temporary folder), then for each shape (batch x seq: 8 x 256, bench/train_throughput.py's,
and 8 x 1024):

1. `loader.batch(step)` over --steps shuffled steps (memory-mapped rows, read in place): median ms;
2. the tiny model's train step on one device at that shape (after a compiling warm-up): median ms;
3. a loop that takes `next(loader)` (read ahead on a thread, depth 3) and runs the step, as the
   training loop does: the mean wait for the batch.

Targets printed against: the step at least 20x the batch read; the prefetched wait under 1% of a step.

Usage: python bench/data_loader.py [--steps 10] [--mb 8] [--json]   (minutes: the 8 x 1024 steps dominate)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from meshlm.data.loader import make_loader  # noqa: E402
from meshlm.data.prepare import prepare_tokens  # noqa: E402
from meshlm.data.tokenizer import train_tokenizer  # noqa: E402
from meshlm.mesh import build_mesh, parse_mesh_dim  # noqa: E402
from meshlm.models.placement import place  # noqa: E402
from meshlm.models.policy import RunPolicy  # noqa: E402
from meshlm.models.presets import resolve_model  # noqa: E402
from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer  # noqa: E402
from meshlm.train.state import create_train_state  # noqa: E402
from meshlm.train.step import make_train_step, put_batch  # noqa: E402

SHAPES = ((8, 256), (8, 1024))  # (global batch, seq_len): train_throughput's, and a longer one
TARGET_STEP_OVER_READ = 20.0
POLICY = RunPolicy(dtype="float32", remat="none")  # the train step the reads are timed against
TARGET_WAIT_SHARE = 0.01
WORDS = "the of and a to in is it that for on with as was by this be are from at or an model data".split()


def write_corpus(folder: Path, megabytes: float) -> Path:
    rng = np.random.default_rng(0)
    vocab = np.array(WORDS + [f"w{i}" for i in range(3000)])
    p = 1.0 / np.arange(1, len(vocab) + 1)  # Zipf-like word frequencies
    path, size = folder / "corpus.jsonl", 0
    with open(path, "w") as f:
        while size < megabytes * 1e6:
            words = rng.choice(vocab, size=int(rng.integers(50, 400)), p=p / p.sum())
            line = json.dumps({"text": " ".join(words)}) + "\n"
            f.write(line)
            size += len(line)
    return path


def train_step_for(cfg, batch: int, seq: int, total_steps: int):
    """(a step function of a host batch that waits for its loss, the compile+first step seconds)."""
    placement = place(cfg, build_mesh(parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1]), policy=POLICY)
    opt_cfg = OptimizerConfig(total_steps=total_steps)
    optimizer = make_optimizer(opt_cfg)
    step = make_train_step(placement, optimizer, lr_schedule(opt_cfg))
    holder = {"state": create_train_state(placement, optimizer, seed=0)}

    def run(host_batch: dict) -> None:
        holder["state"], metrics = step(holder["state"], put_batch(placement, host_batch))
        jax.device_get(metrics["loss"])

    return run


def measure(corpus: str, tok, cfg, batch: int, seq: int, steps: int, cache: Path) -> dict:
    loader = make_loader(corpus, tok, seq, batch, seed=0, cache_dir=cache, prefetch=0)
    first = 10 * loader.steps_per_epoch // 3  # steps past the first epoch, anywhere in the order
    reads = []
    for s in range(first, first + steps):
        t0 = time.perf_counter()
        host = loader.batch(s)
        reads.append(time.perf_counter() - t0)
    run = train_step_for(cfg, batch, seq, 2 * steps + 2)
    t0 = time.perf_counter()
    run(host)
    compile_s = time.perf_counter() - t0
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run(host)
        step_times.append(time.perf_counter() - t0)
    ahead = make_loader(corpus, tok, seq, batch, seed=0, cache_dir=cache, prefetch=3)
    waits = []
    with ahead:
        run(next(ahead))  # the thread starts and fills its queue during a step, as after the compile
        for _ in range(steps):
            t0 = time.perf_counter()
            host = next(ahead)
            waits.append(time.perf_counter() - t0)
            run(host)
    read_ms, step_ms = 1e3 * statistics.median(reads), 1e3 * statistics.median(step_times)
    wait_ms = 1e3 * statistics.fmean(waits)
    return {
        "batch": batch,
        "seq_len": seq,
        "rows": loader.num_rows,
        "read_ms_median": read_ms,
        "step_ms_median": step_ms,
        "compile_s": compile_s,
        "step_over_read": step_ms / read_ms,
        "prefetched_wait_ms_mean": wait_ms,
        "wait_share_of_step": wait_ms / step_ms,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    ap.add_argument("--mb", type=float, default=8.0, help="megabytes of generated text")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.mb <= 0:
        print("--steps must be >= 1 and --mb > 0", file=sys.stderr)
        return 2
    cfg = resolve_model("tiny")
    with tempfile.TemporaryDirectory(prefix="meshlm-bench-data-") as tmp:
        folder = Path(tmp)
        corpus = str(write_corpus(folder, args.mb))
        t0 = time.perf_counter()
        tok = train_tokenizer(corpus, cfg.vocab_size, cache_dir=folder)
        tokens = prepare_tokens(corpus, tok, cache_dir=folder)
        prep_s = time.perf_counter() - t0
        results = [measure(corpus, tok, cfg, b, s, args.steps, folder) for b, s in SHAPES]
    out = {"tokens": int(len(tokens)), "prepare_s": prep_s, "shapes": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"corpus: {len(tokens):,} tokens (tokenizer trained and corpus tokenized in {prep_s:.1f} s)")
    for r in results:
        ok_read = r["step_over_read"] >= TARGET_STEP_OVER_READ
        ok_wait = r["wait_share_of_step"] < TARGET_WAIT_SHARE
        print(
            f"  batch {r['batch']} x seq {r['seq_len']} ({r['rows']:,} rows): batch read {r['read_ms_median']:.3f} ms, "
            f"tiny train step {r['step_ms_median']:.0f} ms -> step/read {r['step_over_read']:,.0f}x "
            f"(target >= {TARGET_STEP_OVER_READ:.0f}x: {'met' if ok_read else 'NOT met'}); prefetched wait "
            f"{r['prefetched_wait_ms_mean']:.3f} ms = {r['wait_share_of_step']:.3%} of a step "
            f"(target < {TARGET_WAIT_SHARE:.0%}: {'met' if ok_wait else 'NOT met'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
