"""Predictions against the compiler: peak memory and collective bytes of the real, compiled train step.

One compile per (model, mesh, remat) case, shared by both assertions; each case is compiled with
abstract inputs on the 8 simulated CPU devices (nothing is allocated).
"""

import jax
import pytest

from meshlm.explain.verify import compile_step, error_percent, measure
from meshlm.mesh import parse_mesh_dim
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.plan import comms, memory
from meshlm.plan.job import Job

GQA = {"n_kv_heads": "4", "n_layers": "3"}
# (model overrides, mesh_dim, batch, seq_len, remat, grad_accum)
CASES = [
    ({}, "8,1,1,1", 8, 32, "none", 1),
    ({}, "1,8,1,1", 8, 32, "none", 1),
    ({}, "1,1,8,1", 8, 32, "none", 1),
    ({}, "1,1,1,8", 8, 32, "none", 1),
    ({}, "2,2,2,1", 8, 32, "none", 1),
    ({}, "2,2,2,1", 8, 32, "save_dots", 1),
    ({}, "1,2,2,2", 8, 32, "save_qkv_attn", 1),
    ({}, "1,2,2,2", 8, 32, "save_attn", 1),
    (GQA, "1,4,2,1", 8, 64, "none", 1),
    (GQA, "2,2,2,1", 16, 32, "full", 1),
    (GQA, "1,2,1,4", 8, 64, "none", 1),
    (GQA, "2,4,1,1", 16, 32, "save_dots", 1),
    (GQA, "4,2,1,1", 16, 32, "none", 2),
]
IDS = [f"{'gqa' if o else 'test'}-{m}-{r}-b{b}-t{t}-a{a}" for o, m, b, t, r, a in CASES]


def job_for(overrides, batch, seq, remat, accum):
    cfg = resolve_model("test", overrides)
    return Job(cfg, batch, seq, 8, accum, policy=RunPolicy(dtype="float32", remat=remat))


@pytest.fixture(scope="module")
def compiled():
    out = {}
    for case, name in zip(CASES, IDS):
        overrides, mesh_dim, batch, seq, remat, accum = case
        job = job_for(overrides, batch, seq, remat, accum)
        shape = parse_mesh_dim(mesh_dim, 8)
        out[name] = (job, shape, measure(compile_step(job, shape, jax.devices()[:8])))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", IDS)
def test_peak_memory_within_10_percent_and_never_3_percent_below(compiled, name):
    job, shape, got = compiled[name]
    err = error_percent(memory.estimate(job, shape).total, got["peak_memory_bytes"])
    assert -3.0 <= err <= 10.0, f"{name}: predicted peak memory {err:+.1f}% off the compiled peak"


@pytest.mark.slow
@pytest.mark.parametrize("name", IDS)
def test_collective_bytes_within_5_percent(compiled, name):
    job, shape, got = compiled[name]
    predicted = comms.total_bytes(comms.predict(job, shape))
    err = error_percent(predicted["total"], got["collective_bytes"]["total"])
    assert abs(err) <= 5.0, f"{name}: predicted collective bytes {err:+.1f}% off the compiled HLO"
