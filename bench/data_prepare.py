"""`meshlm data prepare` against a one-process tokenizer on a generated JSONL corpus: wall time and peak memory.

    python bench/data_prepare.py --mb=2048      # targets: >= 1.2x the baseline's speed, <= 1 GB extra peak memory

The corpus (seeded, English-like: Zipf-distributed made-up words, sentences, documents of varied length) is
written as JSONL files of --file_mb each; a BPE tokenizer is trained on it first (not timed). Then (a) a
baseline script reads every line with json.loads, encodes chunks with `tokenizers`' multi-threaded
encode_batch, keeps the ids in numpy arrays and writes one .npy; (b) `meshlm data prepare` runs as a
subprocess. Each is run on the corpus and on a tiny one; peak memory is the whole process tree's VmRSS
summed every 0.1 s, and the extra peak memory is the corpus run's over the tiny one's (cut into as many
units as there are workers, so that both runs start the same processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

BASELINE = r"""
import json, sys
import numpy as np
import tokenizers
corpus, tokenizer_json, out = sys.argv[1:4]
tok = tokenizers.Tokenizer.from_file(tokenizer_json)
tok.encode_special_tokens = True
eos = tok.token_to_id("<|endoftext|>")
pieces, chunk = [], []
def flush():
    for e in tok.encode_batch(chunk, add_special_tokens=False):
        pieces.append(np.array(e.ids + [eos], np.uint16))
    chunk.clear()
for name in sorted(__import__("os").listdir(corpus)):
    with open(f"{corpus}/{name}", "rb") as f:
        for line in f:
            if line.strip():
                chunk.append(json.loads(line)["text"])
                if len(chunk) == 4096:
                    flush()
flush()
np.save(out, np.concatenate(pieces))
"""


def make_words(rng, n: int) -> np.ndarray:
    """`n` made-up words from syllables, shortest mostly."""
    syllables = np.array([c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ou", "ea")])
    lengths = rng.choice([1, 2, 3, 4], n, p=[0.3, 0.4, 0.2, 0.1])
    return np.array(["".join(rng.choice(syllables, k)) for k in lengths], dtype=object)


def write_corpus(folder: Path, mb: float, file_mb: float, seed: int = 0) -> None:
    """JSONL files of about `file_mb` MB each, `mb` MB in all."""
    rng = np.random.default_rng(seed)
    words = make_words(rng, 20000)
    cdf = np.cumsum(1.0 / np.arange(1, len(words) + 1) ** 1.1)
    dotted, capital = words + ".", np.array([w.capitalize() for w in words], dtype=object)
    folder.mkdir(parents=True, exist_ok=True)
    left, index, per_word = mb * 1e6, 0, 8.0  # bytes a word, measured on each file written
    while left > 0:
        n = int(min(file_mb * 1e6, left) / per_word) + 1
        idx = np.searchsorted(cdf, rng.random(n) * cdf[-1])
        ends = rng.random(n) < 1 / 12
        text = np.where(ends, dotted[idx], np.where(np.roll(ends, 1), capital[idx], words[idx]))
        cuts = np.cumsum((rng.lognormal(5.5, 1.0, n // 50 + 1) + 5).astype(np.int64))
        cuts = [0, *cuts[cuts < n].tolist(), n]
        lines = [json.dumps({"text": " ".join(text[a:b])}) + "\n" for a, b in zip(cuts, cuts[1:]) if b > a]
        with open(folder / f"part-{index:04d}.jsonl", "w") as f:
            f.writelines(lines)
        size = sum(map(len, lines))
        left, index, per_word = left - size, index + 1, size / n


def tree_rss(pid: int) -> int:
    """VmRSS in bytes of `pid` and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def measure(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak memory of the process tree in bytes) of a command that must succeed."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])} failed: {proc.stderr.read()[-2000:]}")
    return seconds, peak


def run_both(corpus: Path, tok_dir: Path, work: Path, workers: int, unit_mb: float | None = None) -> dict:
    """{"baseline": (seconds, peak bytes), "prepare": ...} on `corpus`."""
    cache = work / f"cache-{corpus.name}"
    prepare = [sys.executable, "-m", "meshlm", "data", "prepare", f"--dataset={corpus}", f"--tokenizer={tok_dir}"]
    prepare += [f"--cache_dir={cache}", f"--workers={workers}"] + ([f"--unit_mb={unit_mb}"] if unit_mb else [])
    out = {
        "baseline": measure(
            [sys.executable, "-c", BASELINE, str(corpus), str(tok_dir / "tokenizer.json"), str(work / "b.npy")]
        ),
        "prepare": measure(prepare),
    }
    shutil.rmtree(cache, ignore_errors=True)
    (work / "b.npy").unlink(missing_ok=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=2048, help="corpus size in MB [2048]")
    parser.add_argument("--file_mb", type=float, default=64, help="MB per JSONL file [64]")
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--workers", type=int, help="meshlm data prepare --workers [the CPU count]")
    parser.add_argument("--dir", help="working folder [a temporary one, removed after]")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="meshlm-bench-data-"))
    sys.path.insert(0, str(ROOT))
    from meshlm.data.tokenizer import train_tokenizer

    try:
        t = time.perf_counter()
        write_corpus(work / "corpus", args.mb, args.file_mb)
        write_corpus(work / "tiny", 1, 1, seed=1)
        print(
            f"corpus: {args.mb:g} MB of JSONL in {args.file_mb:g} MB files, written in {time.perf_counter() - t:.0f} s"
        )
        tok = train_tokenizer(str(work / "corpus"), args.vocab_size, cache_dir=work / "tokcache")
        tok_dir = work / "tokenizer"
        tok.save(tok_dir)
        workers = args.workers or os.cpu_count() or 1
        # the tiny corpus in as many units as workers: the same processes, so that the extra is the corpus's own
        tiny = run_both(work / "tiny", tok_dir, work, workers, unit_mb=1 / workers)
        big = run_both(work / "corpus", tok_dir, work, workers)
        for name in ("baseline", "prepare"):
            (s, peak), (_, tiny_peak) = big[name], tiny[name]
            print(
                f"{name:>8}: {s:7.1f} s  {args.mb / s:6.1f} MB/s  peak {peak / 2**20:6.0f} MiB "
                f"(tiny corpus {tiny_peak / 2**20:.0f} MiB, extra {(peak - tiny_peak) / 2**20:.0f} MiB)"
            )
        ratio = big["baseline"][0] / big["prepare"][0]
        extra = (big["prepare"][1] - tiny["prepare"][1]) / 2**20
        print(
            f"speed ratio (prepare over baseline): {ratio:.2f}x on {os.cpu_count()} CPUs, {workers} workers; prepare's extra peak memory: {extra:.0f} MiB"
        )
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
