"""meshlm against MaxText on the same training job, on this CPU: tokens/s of each and their ratio.

The job: synthetic tokens, AdamW, steps 5-14 timed (median), each framework with its own defaults
for everything this script does not set. Each step time is taken as the framework's own loop runs:
MaxText's as it logs it (from one dispatch to the next), meshlm's as `meshlm train` runs (step i+1
dispatched before step i is waited for; from one step's end to the next's). Runs:

  1 device          the benchmark shape on one CPU device
  1,8,1,1           the same shape on 8 simulated devices, fsdp=8
  2,2,2,1           another shape on 8 simulated devices, dp=2 fsdp=2 tp=2 (a check that a lead is
                    not tuned to one shape)

Each run is one fresh process per framework (the device count is fixed when JAX starts), and the two
frameworks alternate run by run so that both see the same load from other jobs. MaxText 0.2.5 needs
Python >= 3.12: it is installed on demand into bench/.maxtext-venv (git-ignored, several GB).

Usage: python bench/maxtext_compare.py [--runs 1dev,1,8,1,1,2,2,2,1] [--repeat 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".maxtext-venv"
MAXTEXT = "maxtext[tpu]==0.2.5"
TIMED = range(5, 15)  # steps 5..14

SHAPES = {
    # name: (layers, d_model, heads, head_dim, mlp, vocab, seq, global batch)
    "bench": (4, 256, 4, 64, 768, 4096, 256, 8),
    "mixed": (2, 384, 6, 64, 1024, 8192, 128, 16),
}
RUNS = {  # run: (shape, devices, mesh dp,fsdp,tp,sp)
    "1dev": ("bench", 1, (1, 1, 1, 1)),
    "1,8,1,1": ("bench", 8, (1, 8, 1, 1)),
    "2,2,2,1": ("mixed", 8, (2, 2, 2, 1)),
}


def _python312() -> str:
    for candidate in ("python3.12", str(Path.home() / ".pyenv/versions/3.12.1/bin/python3.12")):
        found = shutil.which(candidate) or (candidate if Path(candidate).is_file() else None)
        if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
            return found
    sys.exit("error: MaxText 0.2.5 needs Python 3.12; install it (e.g. pyenv install 3.12) and re-run")


def ensure_maxtext() -> Path:
    python = VENV / "bin" / "python"
    if python.is_file() and subprocess.run([python, "-c", "import maxtext"], capture_output=True).returncode == 0:
        return python
    print(f"installing {MAXTEXT} into {VENV} (once; several GB) ...", flush=True)
    subprocess.run([_python312(), "-m", "venv", str(VENV)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", MAXTEXT], check=True)
    return python


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def run_maxtext(python: Path, run: str, workdir: Path) -> list[float]:
    shape, devices, (dp, fsdp, tp, sp) = RUNS[run]
    layers, d, heads, hd, mlp, vocab, seq, batch = SHAPES[shape]
    args = [
        "dataset_type=synthetic",
        f"steps={max(TIMED) + 1}",
        "enable_checkpointing=false",
        "attention=dot_product",
        f"base_emb_dim={d}",
        f"base_num_query_heads={heads}",
        f"base_num_kv_heads={heads}",
        f"base_mlp_dim={mlp}",
        f"base_num_decoder_layers={layers}",
        f"head_dim={hd}",
        f"vocab_size={vocab}",
        f"max_target_length={seq}",
        f"per_device_batch_size={batch // devices}",
        f"ici_data_parallelism={dp}",
        f"ici_fsdp_parallelism={fsdp}",
        f"ici_tensor_parallelism={tp}",
        "skip_jax_distributed_system=True",
        f"run_name=mesh-{run.replace(',', 'x')}",
        f"base_output_directory={workdir}",
    ]
    out = subprocess.run(
        [python, "-m", "maxtext.trainers.pre_train.train", *args],
        capture_output=True,
        text=True,
        env=_env(devices),
        cwd=workdir,
        timeout=1800,
    )
    steps = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"completed step: (\d+), seconds: ([0-9.]+)", out.stdout + out.stderr)
    }
    if not all(s in steps for s in TIMED):
        raise RuntimeError(f"MaxText {run} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return [steps[s] for s in TIMED]


# One meshlm training step on a bench shape, for the scripts here that time one (`build(**flags)`: the
# placement, the state and the jitted step; `batches()`: fresh synthetic batches).
MESHLM_SETUP = r"""
import json, sys, time
import jax, numpy as np
from meshlm.config import TrainConfig
from meshlm.data import pack_rows
from meshlm.job import resolve
from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer
from meshlm.train.state import create_train_state
from meshlm.train.step import make_train_step, put_batch
layers, d, heads, hd, mlp, vocab, seq, batch, mesh_dim, last = json.loads(sys.argv[1])
overrides = dict(n_layers=layers, d_model=d, n_heads=heads, n_kv_heads=heads, head_dim=hd, mlp_dim=mlp,
                 vocab_size=vocab, max_seq_len=max(seq, 256))
def build(**flags):
    cfg = TrainConfig(model="tiny", model_overrides={k: str(v) for k, v in overrides.items()}, mesh_dim=mesh_dim,
                      batch_size=batch, seq_len=seq, **flags)
    job = resolve(cfg)
    opt_cfg = OptimizerConfig(lr=3e-4, total_steps=100)
    optimizer = make_optimizer(opt_cfg)
    return (job.placement, create_train_state(job.placement, optimizer, seed=0),
            make_train_step(job.placement, optimizer, lr_schedule(opt_cfg)))
def batches(placement):
    rng = np.random.default_rng(0)
    while True:
        yield put_batch(placement, pack_rows(rng.integers(1, vocab, (batch, seq + 1)), eos_id=0))
def timed_steps(placement, state, step, n):
    # As `meshlm train` runs them: step i+1 is dispatched before step i is waited for, so the host's work
    # (the next batch, the dispatch) overlaps the devices'. Step i's time: from step i-1 done to step i
    # done (step 1's: from its dispatch, so with its compile).
    source = batches(placement)
    done, pending, times = time.perf_counter(), None, []
    for _ in range(n):
        state, metrics = step(state, next(source))
        if pending is not None:
            jax.block_until_ready(pending)
            times.append(time.perf_counter() - done)
            done = time.perf_counter()
        pending = metrics
    jax.block_until_ready(pending)
    times.append(time.perf_counter() - done)
    return times
"""

MESHLM_STEP = (
    MESHLM_SETUP
    + r"""
placement, state, step = build()
print("STEPS " + json.dumps(timed_steps(placement, state, step, last)))
"""
)


def run_meshlm(run: str) -> list[float]:
    shape, devices, mesh = RUNS[run]
    spec = json.dumps([*SHAPES[shape], ",".join(map(str, mesh)), max(TIMED)])
    env = {**_env(devices), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", MESHLM_STEP, spec], capture_output=True, text=True, env=env, timeout=1800
    )
    found = re.search(r"^STEPS (.*)$", out.stdout, re.M)
    if out.returncode or not found:
        raise RuntimeError(f"meshlm {run} failed:\n{out.stderr[-3000:]}")
    times = json.loads(found.group(1))
    return [times[s - 1] for s in TIMED]


def _versions(python, meshlm: bool = False) -> str:
    """Python and JAX versions of an interpreter, and the compute dtype each framework's default gives here."""
    probe = "import sys, jax; print(f'Python {sys.version.split()[0]}, jax {jax.__version__}', end='')" + (
        "; from meshlm.platform import resolve_dtype; print(', dtype auto =', resolve_dtype('auto', 'cpu'), end='')"
        if meshlm
        else "; print(', dtype bfloat16 (its default)', end='')"
    )
    out = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, env={**_env(1), "PYTHONPATH": str(ROOT)}
    )
    return out.stdout.strip() or out.stderr.strip()[-200:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="1dev,1,8,1,1,2,2,2,1", help="which runs (names above, comma separated)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the two frameworks this many times per run")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    wanted = [r for r in RUNS if r in args.runs]
    python = ensure_maxtext()
    if not args.json:
        print(f"meshlm: {_versions(sys.executable, meshlm=True)}\nMaxText: {_versions(python)}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in wanted:
            shape = SHAPES[RUNS[run][0]]
            tokens = shape[6] * shape[7]
            med = {"meshlm": [], "maxtext": []}
            for _ in range(args.repeat):
                med["maxtext"].append(statistics.median(run_maxtext(python, run, Path(tmp))))
                med["meshlm"].append(statistics.median(run_meshlm(run)))
            row = {name: tokens / statistics.median(v) for name, v in med.items()}
            row["ratio"] = row["meshlm"] / row["maxtext"]
            results[run] = row
            if not args.json:
                print(
                    f"{run:8s} shape {RUNS[run][0]:5s}  meshlm {row['meshlm']:8,.0f} tok/s   MaxText "
                    f"{row['maxtext']:8,.0f} tok/s   meshlm / MaxText = {row['ratio']:.2f}x   (target >= 1.25x)",
                    flush=True,
                )
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
