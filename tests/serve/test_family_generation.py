"""Greedy generation of the open families through the serving engine (KV cache, local layers keeping only
their window in a ring of cache slots, soft caps) against transformers' own greedy `generate` on the same
weights: the same tokens, on one device and with the cache's kv heads split over tp."""

import pytest

from meshlm.checkpoint.weights import load_params, read_model_config
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.serve.engine.batching import Engine
from meshlm.serve.engine.request import GenerationRequest
from meshlm.serve.engine.sampling import SamplingParams
from meshlm.serve.loading import LoadedModel
from tests.support.hf import mesh_of
from tests.support.hf_families import torch_family

F32 = RunPolicy(dtype="float32", param_dtype="float32")

NEW_TOKENS = 12
# Longer than the cases' sliding window of 8, so local layers drop keys while the prompt is read and while
# new tokens are written.
PROMPTS = [[5, 17, 99, 3, 150, 42, 8, 77, 13, 21, 34, 55], [7, 9, 11]]


class _Ids:
    """A tokenizer stand-in: token ids as text, no end-of-text token (every request runs to max_tokens)."""

    eos_id = -1
    vocab_size = 160

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def _transformers_greedy(model, prompt):
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "family, mesh_dim",
    [
        ("gemma2", "1,1,1,1"),
        ("gemma3_text", "1,1,2,1"),
        ("mistral", "1,1,1,1"),
        pytest.param("qwen2", "1,1,2,1", marks=pytest.mark.slow),
        pytest.param("qwen3", "1,1,1,1", marks=pytest.mark.slow),
    ],
)
def test_greedy_generation_equals_transformers(family, mesh_dim, tmp_path):
    model = torch_family(family)
    model.save_pretrained(tmp_path)
    expected = [_transformers_greedy(model, p) for p in PROMPTS]
    cfg = read_model_config(f"hf:{tmp_path}")
    assert cfg.family == family and cfg.sliding_window == 8
    placement = place(cfg, mesh_of(mesh_dim), policy=F32)
    params = load_params(f"hf:{tmp_path}", placement)
    engine = Engine(
        LoadedModel(cfg, placement, params, _Ids(), family), max_batch=2, max_seq_len=32, prefill_buckets=(16,)
    ).start()
    sizes = [c.shape[1] for c in engine.steps.state.cache_k]
    assert sizes == [8 if local else 32 for local in cfg.local_layers]  # local layers: a ring of their window
    try:
        handles = [engine.submit(GenerationRequest(p, NEW_TOKENS, SamplingParams(temperature=0.0))) for p in PROMPTS]
        got = [[t for ev in h.iter_sync(timeout=300) for t in ev.token_ids] for h in handles]
    finally:
        engine.stop()
    assert got == expected and all(len(g) == NEW_TOKENS for g in got)
