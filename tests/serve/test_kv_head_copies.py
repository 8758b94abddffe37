"""Serving a grouped-query model with tp larger than its kv heads: the KV cache holds one copy of a kv
head per tp rank and greedy decoding gives what full forward passes on one device give."""

import jax
import jax.numpy as jnp
import pytest

from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.serve.engine.batching import Engine
from meshlm.serve.engine.request import GenerationRequest
from meshlm.serve.engine.sampling import SamplingParams
from meshlm.serve.loading import LoadedModel
from tests.serve.test_engine import _Ids, _mesh

F32 = RunPolicy(dtype="float32", param_dtype="float32")

CFG = resolve_model("test").replace(n_heads=8, n_kv_heads=2)
PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 52))]
NEW = 12


@pytest.fixture(scope="module")
def host_params():
    return jax.device_get(place(CFG, _mesh("1,1,1,1"), policy=F32).init(seed=1))


@pytest.fixture(scope="module")
def reference(host_params):
    """Greedy continuations by full forward passes without a cache, on one device."""
    placement = place(CFG, _mesh("1,1,1,1"), policy=F32)
    params = jax.device_put(host_params, placement.shardings)
    forward = jax.jit(lambda p, t: placement.apply(p, t))
    width, outs = max(map(len, PROMPTS)) + NEW, []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(NEW):
            logits = forward(params, jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32))
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        outs.append(seq[len(prompt) :])
    return outs


@pytest.mark.parametrize("mesh_dim, heads", [("1,1,4,1", 4), ("1,1,8,1", 8)])
def test_decoding_with_more_tp_ranks_than_kv_heads(host_params, reference, mesh_dim, heads):
    mesh = _mesh(mesh_dim)
    placement = place(CFG, mesh, policy=F32)
    assert placement.cache_heads() == heads
    model = LoadedModel(CFG, placement, jax.device_put(host_params, placement.shardings), _Ids(), "test")
    engine = Engine(model, max_batch=2, max_seq_len=64, prefill_buckets=(16,)).start()
    try:
        handles = [engine.submit(GenerationRequest(p, NEW, SamplingParams(temperature=0.0))) for p in PROMPTS]
        got = [[t for ev in h.iter_sync(timeout=120) for t in ev.token_ids] for h in handles]
    finally:
        engine.stop()
    cache = engine.steps.state.cache_k[0]
    assert cache.shape[2] == heads and cache.sharding.shard_shape(cache.shape)[2] == 1  # one kv head per rank
    assert got == reference
