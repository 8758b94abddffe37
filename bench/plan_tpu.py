"""How well `meshlm plan` predicts a TPU program: memory and collectives against libtpu's compiler.

Each case (model, TPU generation, mesh; 4 chips, bfloat16 compute, float32 parameters, `--remat=full`)
compiles the real train step ahead of time for the TPU topology (`meshlm.explain.verify`, libtpu,
no TPU needed) and compares the plan's per-device peak memory and collective bytes per step (the
`tpu` backend of `meshlm.plan.comms.predict`) with `compiled.memory_analysis()` and the collectives
of the compiled HLO (`meshlm.hlo`). Prints one row per case with both ratios (predicted / compiled),
whether each is within its tolerance (memory ±10%, collectives ±15%), and a count at the end.

Compiles are slow on 2 cores (llama2-7b about 1.5 to 2 minutes each; all 30 cases about 25 minutes):
each case's compiled figures and HLO text are kept under --cache, and a later run reads them back
(so a change to the model is checked in seconds); --fresh compiles again.

Usage: python bench/plan_tpu.py [--models tiny,1b,llama2-7b] [--hardware tpu-v5p,tpu-v5e] [--fresh]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshlm import hlo  # noqa: E402
from meshlm.mesh import parse_mesh_dim  # noqa: E402
from meshlm.models.configs import resolve_model  # noqa: E402
from meshlm.plan import comms, memory  # noqa: E402
from meshlm.plan.job import Job  # noqa: E402

DEVICES = 4
# (batch, seq_len) per model: each compile at most about 2 minutes here.
SHAPES = {"tiny": (8, 512), "1b": (4, 1024), "llama2-7b": (4, 1024)}
MESHES = {"fsdp": "1,4,1,1", "fsdp×tp": "1,2,2,1", "dp×fsdp": "2,2,1,1", "tp": "1,1,4,1", "fsdp×sp": "1,2,1,2"}
MEMORY_TOLERANCE, COLLECTIVE_TOLERANCE = 10.0, 15.0
# The cases `--fit` fits `meshlm.plan.memory.PLACES[tpu-*]` to: other shapes, sizes and remat policies than
# the table's (model, batch, seq_len, remat), each on the table's five meshes. The table checks the fit.
FIT_SET = [("tiny", 4, 1024, "full"), ("tiny", 16, 256, "full"), ("tiny", 8, 512, "save_qkv_attn"),
           ("small", 8, 512, "full"), ("1b", 8, 512, "full")]


def job_for(model: str, batch: int, seq: int, remat: str = "full") -> Job:
    cfg = resolve_model(model, {}).replace(dtype="bfloat16", param_dtype="float32", remat=remat)
    return Job(cfg, batch, seq, DEVICES)


def compiled_figures(job: Job, mesh_dim: str, hardware: str, cache: Path | None, fresh: bool) -> dict:
    """Peak memory and collective bytes of the compiled step (read back from `cache` when there)."""
    from meshlm.explain.verify import compile_step, measure, target_devices

    path = cache / f"{mesh_dim}-{hardware}.json" if cache else None
    if path and path.exists() and not fresh:
        got = json.loads(path.read_text())
        if "error" in got:
            return got
        text = (cache / got["hlo_file"]).read_text()
        got["collective_bytes"] = hlo.summarize(hlo.parse_collectives(text))  # read again: hlo.py may change
        return got
    devices, where = target_devices(DEVICES, hardware)
    if not where.startswith("TPU"):
        raise SystemExit(f"{hardware}: no TPU topology for {DEVICES} chips ({where})")
    t0 = time.perf_counter()
    try:
        compiled = compile_step(job, parse_mesh_dim(mesh_dim, DEVICES), devices)
    except Exception as e:  # noqa: BLE001 - libtpu refuses a program that does not fit the chip's HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        got = {"error": str(e).splitlines()[0][:200]}
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(got))
        return got
    got = measure(compiled)
    got["compile_seconds"] = round(time.perf_counter() - t0, 1)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        got["hlo_file"] = path.with_suffix(".hlo").name
        path.with_suffix(".hlo").write_text(compiled.as_text())
        path.write_text(json.dumps(got))
    return got


def case_row(model: str, mesh_name: str, hardware: str, cache: Path | None, fresh: bool) -> dict:
    batch, seq = SHAPES[model]
    job = job_for(model, batch, seq)
    mesh_dim = MESHES[mesh_name]
    shape = parse_mesh_dim(mesh_dim, DEVICES)
    cached = cache / model if cache else None
    got = compiled_figures(job, mesh_dim, hardware, cached, fresh)
    if "error" in got:
        return {"model": model, "mesh": mesh_name, "mesh_dim": mesh_dim, "hardware": hardware, "batch": batch,
                "seq": seq, "error": got["error"]}
    mem, coll = memory.estimate(job, shape, memory.compiler_for(hardware)).total, comms.total_bytes(comms.predict(job, shape, "tpu"))["total"]
    return {"model": model, "mesh": mesh_name, "mesh_dim": mesh_dim, "hardware": hardware, "batch": batch, "seq": seq,
            "mem": mem, "mem_compiled": got["peak_memory_bytes"], "coll": coll,
            "coll_compiled": got["collective_bytes"]["total"], "seconds": got.get("compile_seconds")}


def fit_rows(hardware: str, cache: Path | None, fresh: bool) -> list[tuple[dict, dict, int]]:
    """(exact parts, term sizes, compiled peak) of every FIT_SET case that compiles for `hardware`."""
    rows = []
    for model, batch, seq, remat in FIT_SET:
        job = job_for(model, batch, seq, remat)
        for mesh_dim in MESHES.values():
            where = cache / f"{model}-b{batch}x{seq}-{remat}" if cache else None
            got = compiled_figures(job, mesh_dim, hardware, where, fresh)
            if "error" not in got:
                rows.append((*memory.terms(job, parse_mesh_dim(mesh_dim, DEVICES)), got["peak_memory_bytes"]))
                print(f"  {model} b{batch}×{seq} {remat} {mesh_dim}: {got['peak_memory_bytes'] / 1e9:.3f} GB",
                      flush=True)
    return rows


def fit_places(rows: list[tuple[dict, dict, int]], start: dict) -> tuple[dict, float]:
    """`PLACES` coefficients for these compiled cases: the smallest worst relative error of the peak, then,
    within 2% of that error, the coefficients nearest `start` (relative), so that a term the cases say
    little about keeps its start value. The peak is params + optimizer + batch + the larger place; each
    case is fitted to the place `start` says is the larger, and the other is kept no higher (repeated
    with the new coefficients until the places stay put). Returns (places, worst error)."""
    import numpy as np
    from scipy.optimize import linprog

    keys = [(place, term) for place, terms in start.items() for term in terms]
    # A term no case has (gradient accumulation, say) keeps its start value.
    free = [k for k in keys if any(sizes[k[1]] for _, sizes, _ in rows)]
    coeffs = {place: dict(terms) for place, terms in start.items()}
    worst = float("inf")
    for _ in range(8):
        def level(place, sizes):
            return sum(c * sizes[t] for t, c in coeffs[place].items())
        chosen = [max(coeffs, key=lambda place: level(place, sizes)) for _, sizes, _ in rows]
        n = len(free)
        a_ub, b_ub = [], []
        for (exact, sizes, peak), top in zip(rows, chosen):
            base = exact["params"] + exact["optimizer"] + exact["batch"]
            for place in coeffs:
                fixed = sum(c * sizes[t] for t, c in coeffs[place].items() if (place, t) not in free)
                row = [sizes[t] if p == place else 0.0 for p, t in free]
                a_ub.append(row + [-peak]); b_ub.append(peak - base - fixed)  # at most (1 + t)·peak
                if place == top:
                    a_ub.append([-x for x in row] + [-peak]); b_ub.append(base + fixed - peak)  # at least (1 - t)·peak
        a_ub, b_ub = np.array(a_ub) / 1e9, np.array(b_ub) / 1e9
        first = linprog([0.0] * n + [1.0], A_ub=a_ub, b_ub=b_ub, bounds=[(0, None)] * (n + 1))
        if not first.success:
            raise SystemExit(f"fit failed: {first.message}")
        # Second pass: the error within 2% of the best, the coefficients as near `start` as that allows.
        s0 = [max(start[p][t], 0.05) for p, t in free]
        m = len(a_ub)
        cost = [0.0] * (n + 1) + [1.0 / s for s in s0]  # variables: c, t (fixed), d = |c - start|
        a2 = [list(r) + [0.0] * n for r in a_ub]
        b2 = list(b_ub)
        for i in range(n):
            up = [0.0] * (2 * n + 1); up[i] = 1.0; up[n + 1 + i] = -1.0
            dn = [0.0] * (2 * n + 1); dn[i] = -1.0; dn[n + 1 + i] = -1.0
            a2 += [up, dn]; b2 += [start[free[i][0]][free[i][1]], -start[free[i][0]][free[i][1]]]
        t_bound = first.x[n] + 0.02
        second = linprog(cost, A_ub=np.array(a2), b_ub=np.array(b2),
                         bounds=[(0, None)] * n + [(t_bound, t_bound)] + [(0, None)] * n)
        x = second.x if second.success else first.x
        for i, (p, t) in enumerate(free):
            coeffs[p][t] = round(float(x[i]), 2)
        new_chosen = [max(coeffs, key=lambda place: level(place, sizes)) for _, sizes, _ in rows]
        worst = max(abs((e["params"] + e["optimizer"] + e["batch"] + max(level(p, s) for p in coeffs)) / y - 1)
                    for e, s, y in rows)
        if new_chosen == chosen:
            break
    return coeffs, worst


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"| {r['model']} b{r['batch']}×{r['seq']} | {r['hardware']} | {r['mesh']} `{r['mesh_dim']}` | "
              f"does not compile: {r['error']} |||||||", flush=True)
        return
    rm, rc = r["mem"] / r["mem_compiled"], r["coll"] / r["coll_compiled"]
    ok_m = abs(rm - 1) * 100 <= MEMORY_TOLERANCE
    ok_c = abs(rc - 1) * 100 <= COLLECTIVE_TOLERANCE
    print(f"| {r['model']} b{r['batch']}×{r['seq']} | {r['hardware']} | {r['mesh']} `{r['mesh_dim']}` | "
          f"{r['mem'] / 1e9:.3f} | {r['mem_compiled'] / 1e9:.3f} | {rm:.3f} {'ok' if ok_m else 'OUT'} | "
          f"{r['coll'] / 1e9:.3f} | {r['coll_compiled'] / 1e9:.3f} | {rc:.3f} {'ok' if ok_c else 'OUT'} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--hardware", default="tpu-v5p,tpu-v5e")
    p.add_argument("--meshes", default=",".join(MESHES), help=f"of {', '.join(MESHES)}")
    p.add_argument("--cache", default="outputs/plan_tpu", help="where compiled figures and HLO are kept ('' for none)")
    p.add_argument("--fresh", action="store_true", help="compile again even when the cache has the case")
    p.add_argument("--fit", action="store_true",
                   help="compile FIT_SET for each --hardware and print the PLACES coefficients fitted to it")
    args = p.parse_args()
    cache = Path(args.cache) if args.cache else None
    if args.fit:
        for hardware in args.hardware.split(","):
            print(f"{hardware}: fit set", flush=True)
            places, worst = fit_places(fit_rows(hardware, cache, args.fresh), memory.PLACES["cpu"])
            print(f'    "{hardware}": {places},  # worst {100 * worst:.1f}% over the fit set')
        return
    print(f"{DEVICES} chips, bfloat16 compute, float32 parameters, --remat=full; ratio = predicted / compiled "
          f"(tolerance: memory ±{MEMORY_TOLERANCE:.0f}%, collectives ±{COLLECTIVE_TOLERANCE:.0f}%)\n")
    print("| model, batch×seq | hardware | mesh | mem GB | compiled | ratio | coll GB/step | compiled | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model in args.models.split(","):
        for hardware in args.hardware.split(","):
            for mesh_name in args.meshes.split(","):
                rows.append(case_row(model, mesh_name, hardware, cache, args.fresh))
                print_row(rows[-1])
    done = [r for r in rows if "error" not in r]
    ok_m = sum(abs(r["mem"] / r["mem_compiled"] - 1) * 100 <= MEMORY_TOLERANCE for r in done)
    ok_c = sum(abs(r["coll"] / r["coll_compiled"] - 1) * 100 <= COLLECTIVE_TOLERANCE for r in done)
    print(f"\nwithin tolerance: memory {ok_m} of {len(done)} compiled cases, collectives {ok_c} of {len(done)}"
          f"{f'; {len(rows) - len(done)} cases do not compile' if len(rows) > len(done) else ''}")



if __name__ == "__main__":
    main()
