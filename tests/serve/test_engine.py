"""The engine against a cache-free reference, on several meshes, and its batching behaviour."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm import mesh as meshlib
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.serve.engine.batching import Engine
from meshlm.serve.engine.request import GenerationRequest
from meshlm.serve.engine.sampling import SamplingParams
from meshlm.serve.engine.shapes import length_buckets
from meshlm.serve.loading import LoadedModel

F32 = RunPolicy(dtype="float32", param_dtype="float32")

CFG = resolve_model("test").replace(n_kv_heads=4)
NEW_TOKENS = 32
PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 52)), [7], [300, 301, 302, 303, 304, 305, 306, 307, 308]]


class _Ids:
    """A tokenizer stand-in: token ids as text, no end-of-text token (every request runs to max_tokens)."""

    eos_id = -1
    vocab_size = CFG.vocab_size

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def _mesh(mesh_dim: str):
    shape = meshlib.parse_mesh_dim(mesh_dim, int(np.prod([int(x) for x in mesh_dim.split(",")])))
    return meshlib.build_mesh(shape, jax.devices()[: shape.n_devices])


@pytest.fixture(scope="module")
def host_params():
    """One set of random weights for every mesh (initialised once: compiling the initialiser is slow on CPU)."""
    return jax.device_get(place(CFG, _mesh("1,1,1,1"), policy=F32).init(seed=0))


def _model(mesh, host_params) -> LoadedModel:
    placement = place(CFG, mesh, policy=F32)
    return LoadedModel(CFG, placement, jax.device_put(host_params, placement.shardings), _Ids(), "test")


@pytest.fixture(scope="module")
def reference(host_params):
    """Greedy continuation by full forward passes without a cache, one token at a time, on one device."""
    placement = place(CFG, _mesh("1,1,1,1"), policy=F32)
    params = jax.device_put(host_params, placement.shardings)
    width = max(map(len, PROMPTS)) + NEW_TOKENS
    forward = jax.jit(lambda p, t: placement.apply(p, t))  # causal: padding after a row's end changes nothing
    outs = []
    for prompt in PROMPTS:
        seq = list(prompt)
        for _ in range(NEW_TOKENS):
            tokens = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
            seq.append(int(jnp.argmax(forward(params, tokens)[0, len(seq) - 1])))
        outs.append(seq[len(prompt) :])
    return outs


@pytest.mark.parametrize("mesh_dim", ["1,1,1,1", "1,1,4,1", "2,1,2,1", "1,1,1,4"])
def test_greedy_with_cache_matches_full_forward(reference, host_params, mesh_dim):
    mesh = _mesh(mesh_dim)
    data = mesh.shape["dp"] * mesh.shape["fsdp"]
    # Fewer slots than requests: the last one joins when a slot frees (continuous batching).
    engine = Engine(
        _model(mesh, host_params), max_batch=2 * data if data > 1 else 2, max_seq_len=64, prefill_buckets=(16,)
    ).start()
    try:
        handles = [engine.submit(GenerationRequest(p, NEW_TOKENS, SamplingParams(temperature=0.0))) for p in PROMPTS]
        got = [[tid for ev in h.iter_sync(timeout=120) for tid in ev.token_ids] for h in handles]
        assert [h.finish_reason for h in handles] == ["length"] * len(PROMPTS)
    finally:
        engine.stop()
    assert got == reference
    assert engine.compiled_shapes() == 2, "traffic after warm-up compiled a new shape"
    assert engine.steps.state.cache_k[0].sharding.spec == place(CFG, mesh, policy=F32).cache_sharding().spec


@pytest.fixture(scope="module")
def engine(host_params):
    eng = Engine(_model(_mesh("1,1,1,1"), host_params), max_batch=4, max_seq_len=64, prefill_buckets=(16, 32)).start()
    yield eng
    eng.stop()


def _ids(handle):
    return [t for ev in handle.iter_sync(timeout=120) for t in ev.token_ids]


def test_seeded_sampling_is_repeatable_and_independent_of_batch_neighbours(engine):
    req = GenerationRequest([1, 2, 3], 12, SamplingParams(temperature=1.0, top_p=0.9, seed=1234))
    alone = _ids(engine.submit(req))
    crowd = [engine.submit(GenerationRequest([9, 8], 12, SamplingParams(temperature=1.5))) for _ in range(3)]
    together = _ids(engine.submit(req))
    for h in crowd:
        _ids(h)
    assert alone == together
    other = _ids(engine.submit(GenerationRequest([1, 2, 3], 12, SamplingParams(temperature=1.0, top_p=0.9, seed=99))))
    assert other != alone


def test_more_requests_than_slots_all_finish_without_recompiling(engine):
    before = engine.compiled_shapes()
    handles = [
        engine.submit(GenerationRequest(list(range(1, 2 + i)), 3 + i % 5, SamplingParams(0.7, seed=i)))
        for i in range(20)
    ]
    for i, h in enumerate(handles):
        ids = _ids(h)
        assert len(ids) == 3 + i % 5 and h.finish_reason == "length"
    assert engine.compiled_shapes() == before


def test_submit_from_many_threads(engine):
    results = {}

    def client(i):
        results[i] = _ids(engine.submit(GenerationRequest([i + 1, i + 2], 5, SamplingParams(0.0))))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(12)) and all(len(r) == 5 for r in results.values())


def test_stop_string_ends_the_text_before_it(engine):
    free = _ids(engine.submit(GenerationRequest([4, 5, 6], 10, SamplingParams(0.0))))
    stop = f" {free[3]}"
    h = engine.submit(GenerationRequest([4, 5, 6], 10, SamplingParams(0.0), stop=(stop,)))
    text, reason = h.result(timeout=60)
    assert reason == "stop"
    full = _Ids().decode(free)
    assert text == full[: full.find(stop)]


def test_cancel_frees_the_slot(engine):
    handles = [engine.submit(GenerationRequest([1], 60, SamplingParams(0.0))) for _ in range(4)]
    for h in handles:
        next(h.iter_sync(timeout=60))
        h.cancel()
    assert all(h.result(timeout=60)[1] == "cancelled" for h in handles)
    assert _ids(engine.submit(GenerationRequest([2], 3, SamplingParams(0.0)))) != []


@pytest.mark.parametrize(
    "prompt, max_tokens, message",
    [
        ([], 4, "empty"),
        ([1] * 40, 4, "longest prompt"),
        ([1] * 30, 40, "exceeds the context"),
        ([1], 0, "positive"),
        ([CFG.vocab_size], 1, "token ids"),
    ],
)
def test_requests_that_cannot_fit_are_refused_up_front(engine, prompt, max_tokens, message):
    with pytest.raises(ValueError, match=message):
        engine.submit(GenerationRequest(prompt, max_tokens))


def test_length_buckets_cover_the_context():
    assert length_buckets(256) == (32, 64, 128, 256)
    assert length_buckets(100) == (32, 64, 100)
