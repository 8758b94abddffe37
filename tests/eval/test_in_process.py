"""`meshlm eval` in-process against lm-eval's own `local-completions` model talking to `meshlm serve` on
loopback (same accuracy, same per-sample log-likelihoods, same greedy generations), and against an
independent forward pass (placement.apply + log_softmax) on the same tokens."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the test extra: pip install -e '.[test]'")

from meshlm.cli import main  # noqa: E402
from meshlm.eval.harness import read_samples  # noqa: E402
from meshlm.models.policy import RunPolicy

F32 = RunPolicy(dtype="float32", param_dtype="float32")

CONTEXT = 128  # in-process: sequences of at most 128 tokens, so windows of 127 predicted tokens
ATOL = 1e-4


@pytest.fixture(scope="module")
def in_process(checkpoint, tasks, tmp_path_factory):
    """`meshlm eval` on the three local tasks, on a 2,1,4,1 mesh: (results JSON, {task: {doc_id: sample}}, stdout)."""
    folder, names = tasks
    out = tmp_path_factory.mktemp("eval_out")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert (
            main(
                [
                    "eval",
                    f"--checkpoint={checkpoint}",
                    "--mesh_dim=2,1,4,1",
                    f"--max_seq_len={CONTEXT}",
                    f"--include_path={folder}",
                    f"--tasks={','.join(names.values())}",
                    "--batch_size=8",
                    f"--output_path={out}",
                    "--log_samples",
                ]
            )
            == 0
        )
    [results_file] = list(out.rglob("results_*.json"))
    samples = {
        name: {s["doc_id"]: s for s in read_samples(next(out.rglob(f"samples_{name}_*.jsonl")))}
        for name in names.values()
    }
    return json.loads(results_file.read_text()), samples, text.getvalue()


@pytest.fixture(scope="module")
def via_server(checkpoint, tasks):
    """lm-eval's `local-completions` against `meshlm serve`'s app (on one model copy over a 1,1,8,1 mesh),
    with the checkpoint's tokenizer: (results, {task: {doc_id: sample}})."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from meshlm.serve.api.routes import create_app
    from meshlm.serve.engine.batching import Engine
    from meshlm.serve.loading import load_model
    from tests.serve.conftest import live_server

    folder, names = tasks
    model, _ = load_model(checkpoint, mesh_dim="1,1,8,1", max_seq_len=256)
    engine = Engine(model, max_batch=8, max_seq_len=256, prefill_buckets=(64, 128, 256)).start()
    try:
        with live_server(create_app(engine)) as url:
            # max_length: lm-eval keeps one token for generation and makes rolling windows of max_length - 2
            # predicted tokens: CONTEXT + 1 gives the in-process windows (CONTEXT - 1).
            args = {
                "model": engine.model_name,
                "base_url": f"{url}/v1/completions",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(checkpoint / "tokenizer"),
                "tokenized_requests": True,
                "max_length": CONTEXT + 1,
            }
            results = simple_evaluate(
                model="local-completions",
                model_args=args,
                tasks=list(names.values()),
                batch_size=8,
                log_samples=True,
                task_manager=TaskManager(include_path=str(folder), include_defaults=False),
            )
    finally:
        engine.stop()
    samples = {name: {s["doc_id"]: s for s in results["samples"][name]} for name in names.values()}
    return results, samples


def _loglikelihoods(sample: dict) -> list[float]:
    return (
        [float(r[0]) for r in sample["filtered_resps"]]
        if isinstance(sample["filtered_resps"][0], (list, tuple))
        else [float(r) for r in sample["filtered_resps"]]
    )


def test_same_accuracy_and_loglikelihoods_as_local_completions_on_meshlm_serve(in_process, via_server, tasks):
    ours, ours_samples, _ = in_process
    theirs, their_samples = via_server
    names = tasks[1]
    mc, rolling, gen = names["mc"], names["rolling"], names["gen"]
    assert ours["results"][mc]["acc,none"] == theirs["results"][mc]["acc,none"]
    assert ours["results"][mc]["acc_norm,none"] == theirs["results"][mc]["acc_norm,none"]
    for task in (mc, rolling):
        assert set(ours_samples[task]) == set(their_samples[task]) == set(range(len(ours_samples[task])))
        for doc_id, sample in ours_samples[task].items():
            np.testing.assert_allclose(
                _loglikelihoods(sample),
                _loglikelihoods(their_samples[task][doc_id]),
                atol=ATOL,
                rtol=0,
                err_msg=f"{task} doc {doc_id}",
            )
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        np.testing.assert_allclose(ours["results"][rolling][metric], theirs["results"][rolling][metric], rtol=1e-4)
    # Greedy generation with stop strings: the same text from the in-process engine and the server's.
    for doc_id, sample in ours_samples[gen].items():
        assert sample["filtered_resps"] == their_samples[gen][doc_id]["filtered_resps"], doc_id
    assert any(s["filtered_resps"][0] for s in ours_samples[gen].values())  # something was generated


def _model_tokens(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's rule for a causal model, written out here: trailing spaces of the context go to the
    continuation, the pair is encoded whole and split after the context's own tokens."""
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole, head = tokenizer.encode(stripped + continuation), tokenizer.encode(stripped)
    return head, whole[len(head) :]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """log p(continuation | context) by one full forward on one device: placement.apply + log_softmax."""
    from meshlm.checkpoint.weights import load_params, read_model_config
    from meshlm.data.tokenizer import Tokenizer
    from meshlm.models.placement import place
    from tests.support.hf import mesh_of

    cfg = read_model_config(str(checkpoint))
    placement = place(cfg, mesh_of("1,1,1,1"), policy=F32)
    params = load_params(str(checkpoint), placement)
    forward = jax.jit(lambda p, t: jax.nn.log_softmax(placement.apply(p, t).astype(jnp.float32), axis=-1))
    tokenizer = Tokenizer.from_file(checkpoint / "tokenizer")  # where `meshlm export` puts it

    def logprob(context_ids: list[int], continuation_ids: list[int]) -> float:
        seq = context_ids + continuation_ids
        padded = np.zeros((1, CONTEXT), np.int32)  # one compiled shape; causal: padding after changes nothing
        padded[0, : len(seq)] = seq
        table = np.asarray(forward(params, padded))[0]
        n = len(context_ids)
        return float(sum(table[n - 1 + i, t] for i, t in enumerate(continuation_ids)))

    return tokenizer, logprob


def test_loglikelihoods_equal_an_independent_forward_pass(in_process, reference, tasks):
    _, samples, _ = in_process
    tokenizer, logprob = reference
    names = tasks[1]
    checked = 0
    for sample in list(samples[names["mc"]].values())[:5]:
        args = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        for (context, continuation), got in zip(args, _loglikelihoods(sample)):
            head, tail = _model_tokens(tokenizer, context, continuation)
            assert abs(logprob(head, tail) - got) < ATOL, (context, continuation)
            checked += 1
    # A rolling document: windows of CONTEXT - 1 predicted tokens, the first after the end-of-text token,
    # each later one seeing the tokens before it up to a full window (one token, except for the last).
    window = CONTEXT - 1
    for sample in list(samples[names["rolling"]].values())[:2]:
        ids = tokenizer.encode(sample["doc"]["text"])
        assert len(ids) > 2 * window and len(ids) % window  # several windows, the last one short
        total = logprob([tokenizer.eos_id], ids[:window])
        for start in range(window, len(ids), window):
            end = min(start + window, len(ids))
            total += logprob(ids[end - window - 1 : start], ids[start:end])
        assert abs(total - _loglikelihoods(sample)[0]) < 10 * ATOL
        checked += 1
    assert checked == 22


def test_prints_a_summary_table_and_writes_lm_evals_json(in_process, tasks):
    results, _, stdout = in_process
    names = tasks[1]
    assert set(names.values()) <= set(results["results"])
    assert {"configs", "versions", "n-shot", "config"} <= set(results)
    for name in names.values():
        assert name in stdout
    for metric in ("acc", "acc_norm", "word_perplexity", "exact_match"):
        assert metric in stdout


def test_registered_as_meshlm_and_scoring_after_generating(checkpoint, tasks, in_process):
    """lm-eval's registry makes a `meshlm` model from model_args once meshlm.eval.lm is imported. The
    generation task runs first, so the engine takes the weights over and the multiple-choice task is
    scored on the engine's copy of them: the same log-likelihoods as the CLI's run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import meshlm.eval.lm  # noqa: F401  (registers the name)

    folder, names = tasks
    lm = lm_eval.api.registry.get_model("meshlm").create_from_arg_obj(
        {"checkpoint": str(checkpoint), "context": 64}, {"batch_size": 4}
    )
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[names["gen"], names["mc"]],
            limit=4,
            log_samples=True,
            task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        )
        assert lm.engine is not None and lm.scorer() is lm.engine.scorer()
    finally:
        lm.close()
    assert list(results["samples"]) == [names["gen"], names["mc"]]
    cli_samples = in_process[1][names["mc"]]
    for sample in results["samples"][names["mc"]]:
        np.testing.assert_allclose(_loglikelihoods(sample), _loglikelihoods(cli_samples[sample["doc_id"]]), atol=ATOL)
    for sample in results["samples"][names["gen"]]:
        assert sample["filtered_resps"] == in_process[1][names["gen"]][sample["doc_id"]]["filtered_resps"]
