"""How the engine shares itself between requests: log-probability scoring in chunks between decode steps
(streams go on beside it, a client that hangs up stops it, shutdown ends it with 503), admission fair
between requests (a batch of many prompts cannot starve a request sent after it), and the limits on
what one request may ask for (4xx) and on the queue (429)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from meshlm.serve.api.routes import create_app
from meshlm.serve.engine.request import GenerationRequest
from meshlm.serve.engine.sampling import SamplingParams

SECONDS_PER_TOKEN = 8e-4  # what a scoring forward costs on the simulated device, per padded token


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        yield http


@pytest.fixture
def slow_scoring(engine, monkeypatch):
    """Scoring as on an accelerator that runs one program at a time, and where a forward's time grows
    with its padded tokens: one lock stands for the device, held by every decode step and by each
    scoring forward for SECONDS_PER_TOKEN per token. One-row chunks (256 padded tokens each here)."""
    scorer = engine.scorer()
    scorer.score([[1] * 250], 0), scorer.score([[1] * 250] * 8, 0)  # compiled outside the measured time
    device = threading.Lock()
    forward, decode = scorer._forward, engine.steps.decode

    def slow_forward(params, tokens):
        with device:
            time.sleep(tokens.size * SECONDS_PER_TOKEN)
            return forward(params, tokens)

    def device_decode(*args):
        with device:
            return decode(*args)

    monkeypatch.setattr(scorer, "_forward", slow_forward)
    monkeypatch.setattr(engine.steps, "decode", device_decode)
    monkeypatch.setattr(engine, "score_chunk_tokens", 256)
    # Every token one character: a stream's event per token (random weights make many partial characters).
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids: "x" * len(ids))
    return scorer


def _scoring_request(prompts: int = 16) -> dict:
    return {"prompt": [[5 + i] * 250 for i in range(prompts)], "max_tokens": 0, "echo": True, "logprobs": 1}


def _wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.usefixtures("slow_scoring")
def test_a_stream_goes_on_while_a_long_request_is_scored(server, http, engine):
    """16 sequences of 250 tokens take 16 × 0.2 s of simulated device; a stream beside them gets a token
    at least every chunk (0.2 s), not once the whole request is scored. The scoring program is compiled
    first, by the same request alone: what is measured is the scheduling, not a compile."""
    assert http.post("/v1/completions", json=_scoring_request()).status_code == 200
    times, started = [], threading.Event()

    def stream():
        body = {"prompt": [71, 111], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server, timeout=60) as own, own.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
                    started.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert started.wait(30)
    t0 = time.perf_counter()
    reply = http.post("/v1/completions", json=_scoring_request())
    t1 = time.perf_counter()
    streaming.join(60)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"][15]["logprobs"]["tokens"]) == 250
    beside = [b - a for a, b in zip(times, times[1:]) if t0 <= b <= t1]
    assert len(beside) >= 8 and max(beside) < (t1 - t0) / 4, (
        f"longest gap between tokens {max(beside, default=t1 - t0):.2f} s while scoring took {t1 - t0:.2f} s",
        [(round(b - t0, 2), round(b - a, 2)) for a, b in zip(times, times[1:]) if t0 <= b <= t1],
    )


@pytest.mark.usefixtures("slow_scoring")
def test_hanging_up_stops_the_scoring(server, engine):
    chunks = engine.stats["score_chunks"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=_scoring_request(), timeout=httpx.Timeout(60, read=0.3))
    _wait_for(lambda: not engine.queue, seconds=1)  # well before the 3.3 s the whole request takes
    assert engine.stats["score_chunks"] - chunks <= 8, "the chunks went on being scored"


@pytest.mark.usefixtures("slow_scoring")
def test_shutdown_during_scoring_answers_503(engine, serve_app):
    replies = []
    with serve_app(create_app(engine), grace_s=0.2) as url:
        client = threading.Thread(
            target=lambda: replies.append(httpx.post(f"{url}/v1/completions", json=_scoring_request(), timeout=60))
        )
        client.start()
        _wait_for(lambda: engine.queue)
        shutdown = time.perf_counter()
    took = time.perf_counter() - shutdown
    client.join(10)
    [reply] = replies
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "shutting_down", reply.text
    assert took < 1.5, took
    _wait_for(lambda: not engine.queue, seconds=1)


def test_too_many_logprobs_are_refused_naming_the_limit(http, engine, monkeypatch):
    monkeypatch.setattr(engine, "max_logprobs", 1000)
    reply = http.post(
        "/v1/completions", json={"prompt": [[7] * 100] * 2, "max_tokens": 0, "echo": True, "logprobs": 5}
    )  # 200 tokens × 6 = 1,200
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "too_many_logprobs" and "1,200" in error["message"], error
    assert "--max_logprobs" in error["message"] and "fewer alternatives" in error["message"], error
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "logprobs": True, "top_logprobs": 20},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs", chat.text
    fits = http.post(
        "/v1/completions", json={"prompt": [[7] * 100] * 2, "max_tokens": 0, "echo": True, "logprobs": 3}
    )  # 800
    assert fits.status_code == 200, fits.text


def test_a_request_sent_after_a_big_batch_is_not_kept_waiting_for_it(engine):
    """32 prompts for 8 slots run in 4 turns; a prompt submitted after them takes the first free slot
    (its submission holds none) rather than waiting for all 32."""
    request = GenerationRequest([5, 6], 24, SamplingParams(0.0), ignore_eos=True)
    batch = engine.submit_batch([request] * 32)
    single = engine.submit(GenerationRequest([7, 8], 4, SamplingParams(0.0), ignore_eos=True))
    next(single.iter_sync(timeout=60))
    finished = sum(h.done for h in batch)
    for h in [single, *batch]:
        h.result(timeout=60)
    assert finished <= 16, f"{finished} of the batch's 32 prompts had finished before the single one started"


def test_batch_limit_and_full_queue(http, engine, monkeypatch):
    body = {"prompt": ["a", "b", "c"], "max_tokens": 20}
    monkeypatch.setattr(engine, "max_request_tokens", 50)
    over = http.post("/v1/completions", json=body)
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "too_many_tokens" and "--max_request_tokens" in over.text, over.text
    monkeypatch.setattr(engine, "max_request_tokens", 60)
    monkeypatch.setattr(engine.queue, "max_queue", 2)
    full = http.post("/v1/completions", json=body)
    assert full.status_code == 429, full.text
    assert full.json()["error"]["code"] == "queue_full" and "--max_queue" in full.text, full.text
    monkeypatch.setattr(engine.queue, "max_queue", 3)
    assert http.post("/v1/completions", json=body).status_code == 200


def test_limit_flags_are_checked_and_documented(capsys):
    from meshlm.cli import main
    from meshlm.serve.engine.limits import MAX_QUEUE

    for flag in ("--max_queue=0", "--max_request_tokens=-1", "--max_logprobs=0"):
        assert main(["serve", "--checkpoint=x", flag]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{flag} must be a positive integer" in err and len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"gets 429 [default: {MAX_QUEUE}]" in out and "--max_logprobs" in out and "--max_request_tokens" in out
