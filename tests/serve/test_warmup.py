"""Warm-up: the order shapes compile in, the progress it reports (callback and the CLI's bar), serving
while the rest compile in the background (/health says how far it is), and no compiling afterwards."""

from __future__ import annotations

import io
import threading

import httpx
import pytest
from rich.console import Console

from meshlm.serve.api.routes import create_app
from meshlm.serve.engine.request import GenerationRequest
from meshlm.serve.engine.sampling import SamplingParams
from meshlm.serve.engine.shapes import plan_shapes
from meshlm.serve.engine.warmup import FIRST, WarmupProgress, plan
from tests.serve.conftest import make_engine

SMALL = dict(max_batch=4, max_seq_len=64, prefill_buckets=(16, 32))  # 2 prefill, 2 decode, 1 scorer shape


def test_plan_puts_the_most_needed_shapes_first():
    shapes = plan_shapes(2048, max_batch=16, max_seq_len=2048, prefill_buckets=None, prefill_batch=None, data=1, sp=1)
    order = plan(shapes, score=(1, 32))
    assert order[:FIRST] == [("prefill", 32), ("decode", 1, 128)]
    assert order[-1] == ("score", 1, 32)
    every = (
        {("prefill", n) for n in shapes.prefill_lengths}
        | {("decode", r, n) for r in shapes.decode_rows for n in shapes.decode_lengths}
        | {("score", 1, 32)}
    )
    assert len(order) == len(every) and set(order) == every
    prefills = [s[1] for s in order if s[0] == "prefill"]
    assert prefills == sorted(prefills), "shorter prompts before longer ones"


def _traffic(engine) -> None:
    """Requests of every prompt bucket, from one to every slot busy, running into the longest cache."""
    handles = [
        engine.submit(GenerationRequest(list(range(1, 1 + n)), engine.max_seq_len - n, SamplingParams(temperature=0.0)))
        for n in (3, 20, 30, 31)
    ]
    for h in handles:
        h.result(timeout=300)


def test_warmup_reports_every_shape_and_nothing_compiles_after():
    engine = make_engine(start=False, **SMALL)
    calls = []
    console = Console(file=io.StringIO(), width=150)
    bar = WarmupProgress(console, on_done=lambda s: calls.append("done"))

    def progress(done, total, compiling):
        calls.append((done, total, compiling))
        bar(done, total, compiling)

    engine.warmup(progress)
    total = len(engine.uncompiled()) + engine.warmed()[0]
    assert engine.warmed() == (total, total) and not engine.uncompiled()
    compiling = [c[2] for c in calls[:-2]]
    assert compiling == plan(engine.shapes, score=(1, 32)), "each shape reported as it compiles, in plan order"
    assert [c[0] for c in calls[:-2]] == list(range(total))
    assert calls[-2:] == [(total, total, None), "done"]
    assert f"{total}/{total}" in console.file.getvalue(), console.file.getvalue()
    steps, scored = engine.compiled_shapes(), engine.scorer().compiled_shapes()
    assert steps == total - 1 and scored == 1  # every prefill and decode shape, the Scorer's smallest bucket
    engine.start(warmup=False)
    try:
        _traffic(engine)
        engine.scorer().score([[5, 6, 7]], top=2)  # the Scorer's smallest bucket: compiled already
    finally:
        engine.stop()
    assert engine.compiled_shapes() == steps, "traffic after warm-up compiled a shape"
    assert engine.scorer().compiled_shapes() == scored


def test_serving_while_the_rest_compile_in_the_background(serve_app):
    engine = make_engine(start=False, **SMALL)
    engine.warmup(count=FIRST)
    total = engine.warmed()[1]
    assert engine.warmed() == (FIRST, total)
    done = threading.Event()
    reports = []

    def progress(compiled, shapes, compiling):
        reports.append((compiled, shapes))
        if compiled == shapes:
            done.set()

    with serve_app(create_app(engine)) as url, httpx.Client(base_url=url, timeout=120) as http:
        health = http.get("/health")  # answered at once: the server does not wait for the rest
        assert health.status_code == 200
        assert health.json() == {
            "status": "warming_up",
            "model": engine.model_name,
            "shapes_compiled": FIRST,
            "shapes": total,
        }
        engine.start(background=True, progress=progress)
        try:
            # A short request needs only the shapes compiled before serving; a long one waits for its own.
            for prompt in ([1, 2], list(range(1, 25))):  # token ids: buckets 16 and 32
                response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert response.status_code == 200, response.text
            assert done.wait(timeout=300), f"warm-up did not finish: {reports}"
            assert http.get("/health").json() == {
                "status": "ok",
                "model": engine.model_name,
                "shapes_compiled": total,
                "shapes": total,
            }
            assert [r[0] for r in reports] == sorted(r[0] for r in reports) and reports[-1] == (total, total)
            steps = engine.compiled_shapes()
            assert steps == total - 1
            _traffic(engine)
        finally:
            engine.stop()
    assert engine.compiled_shapes() == steps, "traffic after the background warm-up compiled a shape"


def test_timeout_flags_are_checked_and_default_to_the_servers(capsys):
    from meshlm.cli import main
    from meshlm.serve.api.timeouts import BODY_TIMEOUT_S, HEADER_TIMEOUT_S

    for flag in ("--header_timeout=0", "--body_timeout=-1"):
        assert main(["serve", "--checkpoint=x", flag]) == 2
        err = capsys.readouterr().err.strip()
        assert "must be a positive number of seconds" in err and len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--header_timeout" in out and f"[default: {HEADER_TIMEOUT_S:g}]" in out
    assert "--body_timeout" in out and f"[default: {BODY_TIMEOUT_S:g}]" in out


def test_bad_shape_flags_name_the_flag():
    from meshlm.errors import UsageError

    kw = dict(max_batch=4, max_seq_len=256, prefill_batch=None, data=1)
    with pytest.raises(
        UsageError,
        match=r"^--prefill_buckets: length 5000 must be between 1 and the context, "
        r"--max_seq_len=256; drop it or raise --max_seq_len$",
    ):
        plan_shapes(2048, prefill_buckets=(10, 5000), sp=1, **kw)
    with pytest.raises(UsageError, match=r"^--prefill_buckets: length 10 must be divisible by 2×sp = 4"):
        plan_shapes(2048, prefill_buckets=(10, 64), sp=2, **kw)
    with pytest.raises(UsageError, match=r"^--max_seq_len=250 must be divisible by 2×sp = 4"):
        plan_shapes(2048, **{**kw, "max_seq_len": 250}, prefill_buckets=None, sp=2)
    assert plan_shapes(2048, prefill_buckets=(10, 64), sp=1, **kw).prefill_lengths == (10, 64)
