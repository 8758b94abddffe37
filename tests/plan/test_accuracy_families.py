"""Predictions against the compiler for the families' variants: a gemma-like test model (tied head,
post-norms, q/k norms, soft caps, an LG pattern of local and global layers) and a qwen2-like one (q/k/v
biases). Collective bytes within 5% and the peak within -3%..+10% of the compiled train step, as
tests/plan/test_accuracy.py checks LLaMA's."""

import jax
import pytest

from meshlm.explain.verify import compile_step, error_percent, measure
from meshlm.mesh import parse_mesh_dim
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.plan import comms, memory
from meshlm.plan.job import Job

GEMMA_LIKE = {
    "n_kv_heads": "4", "n_layers": "4", "post_norms": "true", "qk_norm": "true", "norm_offset": "1.0",
    "embed_scale": "true", "mlp_activation": "gelu_tanh", "sliding_window": "16", "layer_pattern": "LG",
    "attn_logit_softcap": "50.0", "final_logit_softcap": "30.0", "tie_embeddings": "true", "family": "gemma2",
}  # fmt: skip
QWEN2_LIKE = {"n_kv_heads": "4", "n_layers": "3", "qkv_bias": "true", "family": "qwen2"}
CASES = [("gemma", GEMMA_LIKE, "2,2,2,1"), ("gemma", GEMMA_LIKE, "1,2,1,4"), ("qwen2", QWEN2_LIKE, "2,2,2,1")]
IDS = [f"{name}-{mesh}" for name, _, mesh in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_collectives_and_peak_of_the_families_variants(case):
    _, overrides, mesh_dim = case
    job = Job(resolve_model("test", overrides), 16, 64, 8, policy=RunPolicy(dtype="float32", remat="none"))
    shape = parse_mesh_dim(mesh_dim, 8)
    got = measure(compile_step(job, shape, jax.devices()[:8]))
    coll = error_percent(comms.total_bytes(comms.predict(job, shape))["total"], got["collective_bytes"]["total"])
    peak = error_percent(memory.estimate(job, shape).total, got["peak_memory_bytes"])
    assert abs(coll) <= 5.0, f"collective bytes {coll:+.1f}% off the compiled HLO"
    assert -3.0 <= peak <= 10.0, f"peak memory {peak:+.1f}% off the compiled peak"
