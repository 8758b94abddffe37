"""Generation speed on CPU: meshlm's engine against Hugging Face `transformers`, same weights, one run.

Random weights of a preset (default `small`) are written as a Hugging Face LlamaForCausalLM folder;
meshlm reads that folder into its engine (mesh 1,1,1,1, one CPU device that uses every core) and
`transformers` loads it with `from_pretrained` (PyTorch CPU, float32). Both then generate greedily
from the same random prompts:

- decode tokens/s at batch 1 and batch 16: B rows of --prompt_len tokens, --new_tokens new tokens
  each. Only the decode phase is timed: from the moment every row has its first token to the last
  token, B × (new_tokens - 1) tokens. On the meshlm side that is the requests' first-token times to
  the last request's end (every row decodes in the same steps); on the transformers side a logits
  processor notes the time of each step's logits, so the clock starts after the prefill's step.
- time to first token for a --ttft_prompt-token prompt (batch 1): meshlm, from `submit` to the first
  token on the host; transformers, a whole `generate(max_new_tokens=1)`.

Also measured in the run, to show what bounds decoding here: the time to read every weight once
(a jitted sum over the engine's weights, which a batch-1 step must stream from memory: a ceiling
on batch-1 tokens/s), and the engine's own decode step timed alone at batch 1 and at batch 16.

Both sides are warmed up first (meshlm compiles every shape in `Engine.start`; transformers runs
each measurement once untimed). Each measurement is repeated --repeats times, the two sides
alternating so that both see the same load, each run after a --pause of rest (so that the other
side's worker threads, which spin a while after their work, are idle: without it transformers ran
up to 50x slower on 2 cores), and the median is reported. Printed: each figure and the
ratio meshlm / transformers (for TTFT, meshlm's time / transformers' time), against the targets
of issue 5: >= 3x decode tokens/s at batch 1, >= 5x at batch 16, TTFT <= 0.5x.

The engine serves all measurements with one configuration, as a server would: --max_batch slots
(16), a KV cache of --max_seq_len tokens, prefill buckets for the two prompt lengths. Its tokenizer
is a stand-in that prints ids (the benchmark is about the model; transformers detokenizes nothing).

Usage: python bench/generate.py [--preset small] [--dtype float32] [--repeats 3] [--json]
(a few minutes on 2 cores; the machine is shared, so compare ratios, not times)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from meshlm import mesh as meshlib  # noqa: E402
from meshlm.models.configs import describe  # noqa: E402
from meshlm.models.presets import PRESETS, resolve_model

TARGETS = {"decode_b1": 3.0, "decode_b16": 5.0, "ttft": 0.5}  # ratios; TTFT is a ceiling, the rest floors


class IdsTokenizer:
    """Token ids as text; no end-of-text token, so every request runs to max_tokens."""

    eos_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def prompts(vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, (batch, length)).astype(np.int64)


# ---------------------------------------------------------------------------------------- meshlm


def build_engine(hf_dir: Path, args):
    from meshlm.checkpoint.hf_folder import HFSource
    from meshlm.models.placement import place
    from meshlm.models.policy import RunPolicy
    from meshlm.serve.engine.batching import Engine
    from meshlm.serve.loading import LoadedModel

    mesh = meshlib.build_mesh(meshlib.parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1])
    with HFSource(hf_dir) as source:
        cfg = source.cfg
        placement = place(cfg, mesh, policy=RunPolicy(dtype=args.dtype, param_dtype="float32", remat="none"))
        params = source.load(placement)
    model = LoadedModel(cfg, placement, params, IdsTokenizer(cfg.vocab_size), args.preset)
    buckets = tuple(sorted({_bucket(args.prompt_len), _bucket(args.ttft_prompt)}))
    t0 = time.perf_counter()
    engine = Engine(model, max_batch=args.max_batch, max_seq_len=args.max_seq_len, prefill_buckets=buckets).start()
    return engine, time.perf_counter() - t0


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def meshlm_decode(engine, rows: np.ndarray, new_tokens: int) -> float:
    """Decode tokens/s of one batch (every row prefilled first, then decoded together)."""
    from meshlm.serve.engine.request import GenerationRequest
    from meshlm.serve.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    handles = [engine.submit(GenerationRequest(r.tolist(), new_tokens, greedy, ignore_eos=True)) for r in rows]
    for h in handles:
        _, reason = h.result(timeout=600)
        assert reason == "length" and h.completion_tokens == new_tokens, (reason, h.completion_tokens)
    end = time.perf_counter()
    start = max(h.first_token_at for h in handles)
    return len(rows) * (new_tokens - 1) / (end - start)


def meshlm_ttft(engine, prompt: np.ndarray) -> float:
    from meshlm.serve.engine.request import GenerationRequest
    from meshlm.serve.engine.sampling import SamplingParams

    h = engine.submit(GenerationRequest(prompt.tolist(), 1, SamplingParams(temperature=0.0), ignore_eos=True))
    for _ in h.iter_sync(timeout=600):
        return time.perf_counter() - h.submitted
    raise RuntimeError("no token")


# ---------------------------------------------------------------------------------- transformers


def load_hf(hf_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    return model


class _StepClock:
    """A logits processor that notes when each generation step's logits are ready."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate(model, rows: np.ndarray, new_tokens: int) -> tuple[list[float], float]:
    import torch
    from transformers import LogitsProcessorList

    clock = _StepClock()
    ids = torch.from_numpy(rows)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
    end = time.perf_counter()
    assert out.shape == (len(rows), rows.shape[1] + new_tokens), out.shape
    return clock.times, end


def hf_decode(model, rows: np.ndarray, new_tokens: int) -> float:
    times, end = hf_generate(model, rows, new_tokens)
    return len(rows) * (new_tokens - 1) / (end - times[0])


def hf_ttft(model, prompt: np.ndarray) -> float:
    t0 = time.perf_counter()
    hf_generate(model, prompt[None], 1)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model shape [default: small]")
    ap.add_argument("--dtype", default="float32", help="meshlm compute dtype (weights stay float32) [default: float32]")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes [default: 1,16]")
    ap.add_argument("--prompt_len", type=int, default=32, help="prompt tokens per row when timing decode")
    ap.add_argument("--new_tokens", type=int, default=64, help="tokens generated per row when timing decode")
    ap.add_argument("--ttft_prompt", type=int, default=512, help="prompt tokens when timing the first token")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of each measurement (median reported)")
    ap.add_argument("--pause", type=float, default=0.5, help="seconds of rest before each timed run")
    ap.add_argument("--max_batch", type=int, default=16, help="the engine's decode slots")
    ap.add_argument("--max_seq_len", type=int, default=1024, help="the engine's KV cache length")
    ap.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if (
        max(batches) > args.max_batch
        or args.ttft_prompt + 1 > args.max_seq_len
        or args.prompt_len + args.new_tokens > args.max_seq_len
        or args.new_tokens < 2
        or args.repeats < 1
    ):
        print(
            "need batches <= --max_batch, prompts + new tokens <= --max_seq_len, --new_tokens >= 2, --repeats >= 1",
            file=sys.stderr,
        )
        return 2

    import torch
    import transformers

    from meshlm.checkpoint.hf_folder import write_hf
    from meshlm.checkpoint.source import ArraySource
    from meshlm.models.placement import place
    from meshlm.models.policy import RunPolicy

    cfg = resolve_model(args.preset).replace(
        max_seq_len=max(resolve_model(args.preset).max_seq_len, args.max_seq_len),
    )
    print(f"preset {args.preset}: {describe(cfg)}")
    print(
        f"jax {jax.__version__} ({jax.devices()[0].platform}, meshlm dtype {args.dtype}); torch {torch.__version__} "
        f"({torch.get_num_threads()} threads, float32); transformers {transformers.__version__}; "
        f"{os.cpu_count()} cpus"
    )
    with tempfile.TemporaryDirectory(prefix="meshlm-bench-") as tmp:
        hf_dir = Path(tmp) / "hf"
        mesh = meshlib.build_mesh(meshlib.parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1])
        params = jax.device_get(place(cfg, mesh, policy=RunPolicy(dtype="float32")).init(seed=0))
        write_hf(ArraySource(params, cfg), hf_dir, "float32")
        del params
        hf_model = load_hf(hf_dir)
        engine, compile_s = build_engine(hf_dir, args)
    print(
        f"meshlm engine: max_batch {args.max_batch}, cache {args.max_seq_len} tokens, prefill buckets "
        f"{engine.buckets}, compiled in {compile_s:.1f} s"
    )
    shapes = engine.compiled_shapes()
    try:
        results = run(engine, hf_model, cfg, batches, args)
        assert engine.compiled_shapes() == shapes, "the benchmark's traffic compiled a new shape"
    finally:
        engine.stop()
    b = bounds(engine, max(args.repeats, 5))  # the engine's thread is stopped: the steps run alone
    nbytes = sum(a.nbytes for a in jax.tree.leaves(engine.steps.params))
    ceiling = 1 / b["weights"]
    rows = engine.decode_rows[-1]
    print(
        f"bounds: reading all {nbytes / 1e6:.0f} MB of weights once takes {b['weights'] * 1e3:.1f} ms "
        f"({nbytes / b['weights'] / 1e9:.1f} GB/s): at most {ceiling:.1f} tok/s at batch 1, "
        f"{ceiling / results['decode_b1']['transformers']:.2f}x transformers' measured rate"
        if "decode_b1" in results
        else ""
    )
    print(
        f"        engine decode step alone: batch {engine.decode_rows[0]} {b[f'step_b{engine.decode_rows[0]}'] * 1e3:.1f} ms, "
        f"batch {rows} {b[f'step_b{rows}'] * 1e3:.1f} ms ({rows / b[f'step_b{rows}']:.0f} tok/s)"
    )
    results["bounds"] = {"weight_bytes": nbytes, **b}
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def bounds(engine, repeats: int) -> dict:
    """Time to stream every weight once, and the engine's decode step alone (batch 1 and all rows,
    the shortest cache prefix), each the median of `repeats` runs after a warm-up."""
    read_all = jax.jit(lambda p: sum(jnp.sum(a) for a in jax.tree.leaves(p)))
    steps = {"weights": lambda: read_all(engine.steps.params)}
    for rows in (engine.decode_rows[0], engine.decode_rows[-1]):

        def step(rows=rows):
            tokens = engine.steps.decode(rows, engine.decode_lengths[0])
            return tokens

        steps[f"step_b{rows}"] = step
    out = {}
    for name, fn in steps.items():
        jax.block_until_ready(fn())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def run(engine, hf_model, cfg, batches, args) -> dict:
    jobs = {}
    for b in batches:
        rows = prompts(cfg.vocab_size, b, args.prompt_len, seed=b)
        jobs[f"decode_b{b}"] = (
            "tokens/s",
            lambda r=rows: meshlm_decode(engine, r, args.new_tokens),
            lambda r=rows: hf_decode(hf_model, r, args.new_tokens),
        )
    long = prompts(cfg.vocab_size, 1, args.ttft_prompt, seed=99)[0]
    jobs["ttft"] = ("s", lambda: meshlm_ttft(engine, long), lambda: hf_ttft(hf_model, long))

    results = {}
    for name, (unit, ours, theirs) in jobs.items():
        a, b = [], []
        for i in range(args.repeats + 1):  # the first round warms up
            for fn, out in ((ours, a), (theirs, b)):
                time.sleep(args.pause)  # let the other side's thread pool go idle (they spin a while)
                value = fn()
                if i:
                    out.append(value)
        m, t = statistics.median(a), statistics.median(b)
        ratio = m / t
        target = TARGETS.get(name)
        if name == "ttft":
            label, ok = f"TTFT, {args.ttft_prompt}-token prompt", target is None or ratio <= target
            figure = f"meshlm {m * 1e3:8.1f} ms   transformers {t * 1e3:8.1f} ms   meshlm/transformers {ratio:5.2f}x"
            goal = f"(target <= {target}x)"
        else:
            label, ok = f"decode, batch {name[len('decode_b') :]}", target is None or ratio >= target
            figure = f"meshlm {m:8.1f} tok/s   transformers {t:8.1f} tok/s   meshlm/transformers {ratio:5.2f}x"
            goal = f"(target >= {target}x)" if target else ""
        verdict = "" if target is None else ("met" if ok else "MISSED")
        print(f"{label:28s} {figure}  {goal} {verdict}")
        print(f"{'':28s} meshlm runs {_fmt(a, unit)}; transformers runs {_fmt(b, unit)}")
        results[name] = {
            "unit": unit,
            "meshlm": m,
            "transformers": t,
            "ratio": ratio,
            "target": target,
            "met": ok,
            "meshlm_runs": a,
            "transformers_runs": b,
        }
    return results


def _fmt(values, unit) -> str:
    return ", ".join(f"{v * 1e3:.0f} ms" if unit == "s" else f"{v:.1f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
