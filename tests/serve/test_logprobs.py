"""Log-probabilities from the HTTP API against meshlm's in-process scorer and Hugging Face transformers
on the same weights (a tiny LLaMA with GQA, rope_theta 5e5 and Llama-3 rope scaling, float32), and
every prompt form, `echo`, `max_tokens: 0`, nulls, chat logprobs and batching."""

from __future__ import annotations

import json

import httpx
import jax
import numpy as np
import pytest

from meshlm.checkpoint.weights import load_params, read_model_config
from meshlm.data.tokenizer import train_tokenizer
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.serve.api.routes import create_app
from meshlm.serve.engine.batching import Engine
from meshlm.serve.engine.scoring import Scorer
from meshlm.serve.loading import LoadedModel
from tests.support.hf import mesh_of, small_hf_config, torch_llama, torch_logits

F32 = RunPolicy(dtype="float32")

VOCAB = 512
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
PROMPTS = [[11, 300, 42, 7, 99, 250, 3], [5, 17, 400, 23], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72]]
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    model = torch_llama(
        small_hf_config(
            vocab_size=VOCAB,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_theta": 500000.0, **LLAMA3},
        )
    )
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(hf_model):
    cfg = read_model_config(f"hf:{hf_model[1]}")
    assert cfg.n_kv_heads < cfg.n_heads and cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    placement = place(cfg, mesh_of("1,1,2,1"), policy=F32)
    params = load_params(f"hf:{hf_model[1]}", placement)
    tokenizer = train_tokenizer("stdlib", VOCAB, train_chars=400_000)
    return cfg, placement, params, tokenizer


@pytest.fixture(scope="module")
def in_process(loaded):
    cfg, placement, params, tokenizer = loaded
    return Scorer.from_model(LoadedModel(cfg, placement, params, tokenizer, "hf-tiny"), max_len=64, max_batch=4)


@pytest.fixture(scope="module")
def hf_engine(loaded):
    cfg, placement, params, tokenizer = loaded
    engine = Engine(
        LoadedModel(cfg, placement, params, tokenizer, "hf-tiny"), max_batch=4, max_seq_len=64, prefill_buckets=(32, 64)
    ).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def http(hf_engine, serve_app):
    with serve_app(create_app(hf_engine)) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def hf_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """log p(token | before) from transformers, [n, V] for positions 0..n-1 (row t predicts token t + 1)."""
    logits = torch_logits(hf_model[0], np.asarray([ids])).astype(np.float64)[0]
    return (
        logits
        - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )


def hf_greedy(hf_model, ids: list[int], n: int, eos: int) -> list[int]:
    seq = list(ids)
    for _ in range(n):
        nxt = int(np.argmax(hf_logprobs(hf_model, seq)[-1]))
        if nxt == eos:
            break
        seq.append(nxt)
    return seq[len(ids) :]


def post(http, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_echoed_prompts_match_transformers_and_the_in_process_scorer(http, hf_model, in_process, loaded):
    tokenizer = loaded[3]
    reply = post(http, "/v1/completions", {"prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 5})
    scored = in_process.score(PROMPTS, top=5)
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert reply["usage"] == {
        "prompt_tokens": sum(map(len, PROMPTS)),
        "completion_tokens": 0,
        "total_tokens": sum(map(len, PROMPTS)),
    }
    for choice, ids, mine in zip(reply["choices"], PROMPTS, scored):
        lp = choice["logprobs"]
        assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = hf_logprobs(hf_model, ids)
        np.testing.assert_allclose(
            lp["token_logprobs"][1:], [want[t - 1, ids[t]] for t in range(1, len(ids))], atol=ATOL, rtol=0
        )
        np.testing.assert_allclose(lp["token_logprobs"][1:], mine.logprobs[1:], atol=1e-6, rtol=0)
        for t in range(1, len(ids)):
            top = lp["top_logprobs"][t]
            best = np.argsort(-want[t - 1])[:5]
            expected = {}  # tokens whose texts are the same (bytes of one character) share an entry: the likeliest
            for b in best:
                expected.setdefault(tokenizer.decode([int(b)]), want[t - 1, b])
            assert set(expected) <= set(top) and len(top) <= 6
            np.testing.assert_allclose([top[k] for k in expected], list(expected.values()), atol=ATOL, rtol=0)
            np.testing.assert_array_equal(mine.top_ids[t], best)
            np.testing.assert_allclose(mine.top_logprobs[t], want[t - 1, best], atol=ATOL, rtol=0)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        np.testing.assert_array_equal(mine.top_ids[1:, 0], np.argmax(want[:-1], -1))


def test_generated_tokens_match_transformers(http, hf_model, in_process, loaded):
    tokenizer = loaded[3]
    prompt = PROMPTS[0]
    expected = hf_greedy(hf_model, prompt, 8, tokenizer.eos_id)
    for echo in (False, True):
        reply = post(
            http, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": echo}
        )
        [choice] = reply["choices"]
        lp = choice["logprobs"]
        shown = prompt + expected if echo else expected
        assert lp["tokens"] == [tokenizer.decode([t]) for t in shown]
        assert reply["usage"]["completion_tokens"] == len(expected)
        want = hf_logprobs(hf_model, prompt + expected)
        got = lp["token_logprobs"][len(prompt) :] if echo else lp["token_logprobs"]
        np.testing.assert_allclose(got, [want[len(prompt) + i - 1, t] for i, t in enumerate(expected)], atol=ATOL)
        assert all(
            max(top.values()) == logprob for top, logprob in zip(lp["top_logprobs"][-len(expected) :], got)
        )  # greedy: the chosen is the best
        [mine] = in_process.score([prompt + expected], top=2)
        np.testing.assert_allclose(got, mine.logprobs[len(prompt) :], atol=1e-6)
        text = choice["text"]
        assert text == (tokenizer.decode(prompt) if echo else "") + tokenizer.decode(expected)
        assert all(text[o:].startswith(tok) for o, tok in zip(lp["text_offset"], lp["tokens"]) if tok.isascii())


def test_lm_eval_loglikelihood_request(http, hf_model, hf_engine, loaded):
    """What lm-evaluation-harness's `local-completions` sends for loglikelihood, and how it reads the reply."""
    tokenizer = loaded[3]
    context = [11, 300, 42]
    best = int(np.argmax(hf_logprobs(hf_model, context)[-1]))
    prompts = [context + [7, 99], context + [best]]  # a continuation the model would not pick, and one it would
    body = {
        "model": hf_engine.model_name,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    reply = post(http, "/v1/completions", body)
    for choice, prompt in zip(sorted(reply["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        ctxlen = len(context)
        # lm-eval drops the generated token with [:-1]; here the model may also have ended at once (eos)
        shown = lp["token_logprobs"][ctxlen : len(prompt)]
        tops = lp["top_logprobs"][ctxlen : len(prompt)]
        want = hf_logprobs(hf_model, prompt)
        np.testing.assert_allclose(
            sum(shown), sum(want[t - 1, prompt[t]] for t in range(ctxlen, len(prompt))), atol=ATOL
        )
        is_greedy = all(logprob == max(top.values()) for logprob, top in zip(shown, tops))
        assert is_greedy == all(int(np.argmax(want[t - 1])) == prompt[t] for t in range(ctxlen, len(prompt)))
        assert lp["tokens"][: len(prompt)] == [tokenizer.decode([t]) for t in prompt]


def test_every_prompt_form_and_nulls(http, loaded):
    tokenizer = loaded[3]
    texts = ["The cat", "A dog and a bird"]
    common = {"max_tokens": 3, "temperature": 0, "echo": True}
    alone = [post(http, "/v1/completions", {**common, "prompt": t})["choices"][0]["text"] for t in texts]
    assert all(a.startswith(t) for a, t in zip(alone, texts))
    as_strings = post(http, "/v1/completions", {**common, "prompt": texts})["choices"]
    as_ids = post(http, "/v1/completions", {**common, "prompt": [tokenizer.encode(t) for t in texts]})["choices"]
    one_ids = post(http, "/v1/completions", {**common, "prompt": tokenizer.encode(texts[1])})["choices"]
    assert [c["text"] for c in as_strings] == [c["text"] for c in as_ids] == alone
    assert one_ids[0]["text"] == alone[1] and [c["index"] for c in as_strings] == [0, 1]
    nulls = {
        "prompt": "Hi",
        "max_tokens": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "n": None,
        "stop": None,
        "seed": None,
        "stream": None,
        "stream_options": None,
        "logprobs": None,
        "echo": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "logit_bias": None,
        "user": None,
        "suffix": None,
        "best_of": None,
        "model": None,
    }
    reply = post(http, "/v1/completions", nulls)
    assert reply["choices"][0]["logprobs"] is None and 1 <= reply["usage"]["completion_tokens"] <= 16
    chat_nulls = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "logprobs": None,
        "top_logprobs": None,
        "max_completion_tokens": None,
        "temperature": None,
        "stop": None,
    }
    assert post(http, "/v1/chat/completions", chat_nulls)["choices"][0]["logprobs"] is None


def test_chat_logprobs(http, hf_model, loaded):
    tokenizer = loaded[3]
    reply = post(
        http,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    [choice] = reply["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    prompt_ids = tokenizer.encode("User: Hello there\n\nAssistant:")
    generated = hf_greedy(hf_model, prompt_ids, len(content), tokenizer.eos_id)
    assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in generated]
    want = hf_logprobs(hf_model, prompt_ids + generated)
    for i, (entry, token) in enumerate(zip(content, generated)):
        row = want[len(prompt_ids) + i - 1]
        assert entry["logprob"] == pytest.approx(row[token], abs=ATOL)
        assert entry["bytes"] == list(entry["token"].encode())
        assert [alt["token"] for alt in entry["top_logprobs"]] == [
            tokenizer.decode([int(t)]) for t in np.argsort(-row)[:3]
        ]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(row.max(), abs=ATOL)


def test_batched_prompts_run_as_one_batch(http, hf_engine):
    scorer = hf_engine.scorer()
    chunks, steps = hf_engine.stats["score_chunks"], hf_engine.stats["decode_steps"]
    reply = post(
        http,
        "/v1/completions",
        {"prompt": [[5 + i, 9, 13] for i in range(4)], "max_tokens": 12, "temperature": 0, "logprobs": 1},
    )
    generated = reply["usage"]["completion_tokens"]
    steps = hf_engine.stats["decode_steps"] - steps
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert hf_engine.stats["score_chunks"] - chunks == 1, "the prompts were not scored in one batch"
    assert generated > 12 and steps <= 16, f"{generated} tokens took {steps} decode steps: not one batch"
    compiled = scorer.compiled_shapes()
    post(http, "/v1/completions", {"prompt": [[7, 8, 9]] * 3, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert scorer.compiled_shapes() == compiled, "a repeated shape compiled again"


@pytest.mark.parametrize(
    "body, named",
    [
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "Hi", "logprobs": 1, "stream": True}, "logprobs"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt"),
        ({"prompt": [], "max_tokens": 1}, "prompt"),
        ({"prompt": [[1, 2], "x", 3]}, "prompt"),
        ({"prompt": [[1, 2], [VOCAB]]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [[1] * 65], "max_tokens": 0, "echo": True}, "prompt"),
        ({"prompt": "Hi", "echo": "yes"}, "echo"),
    ],
)
def test_bad_completion_fields_are_400(http, body, named):
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in (error["param"] or "") or named in error["message"], error


def test_chat_top_logprobs_needs_logprobs(http):
    response = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"


def test_in_process_scorer_takes_stacked_and_split_weights(in_process, hf_engine):
    seqs = [PROMPTS[1], PROMPTS[2]]
    a, b = in_process.score(seqs, top=4), hf_engine.scorer().score(seqs, top=4)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)
        np.testing.assert_array_equal(x.top_ids, y.top_ids)
        assert x.total(2) == pytest.approx(float(np.sum(x.logprobs[2:], dtype=np.float64)), abs=1e-9)
    assert jax.tree.leaves(in_process.params)  # the scorer did not take the weights away


def test_streamed_echo_starts_with_the_prompt(http):
    body = {"prompt": "The cat", "max_tokens": 4, "temperature": 0, "echo": True}
    whole = post(http, "/v1/completions", body)["choices"][0]["text"]
    streamed = http.post("/v1/completions", json={**body, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == whole
    assert json.loads(events[0])["choices"][0]["text"] == "The cat"
