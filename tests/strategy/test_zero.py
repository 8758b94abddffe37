"""ZeRO stages 0-3: per-device memory of parameters + gradients + optimizer state follows the formula,
stage 2 reduce-scatters its gradients where stage 0 all-reduces them, and every stage trains alike."""

import jax
import numpy as np
import pytest

from meshlm.explain.analysis import collectives, state_memory
from meshlm.hlo import parse_collectives
from tests.support.training import run_strategy as run

MESH = {0: "8,1,1,1", 1: "8,1,1,1", 2: "8,1,1,1", 3: "1,8,1,1"}
# Every run starts from the one-device initial state laid out for its stage (shared_init): a ZeRO stage
# moves optimizer state and gradients, not the values a fresh state holds. (That a state made on a mesh
# holds those values stays checked where meshes are the subject: tests/train/test_train_step.py (8,1,1,1,
# 1,8,1,1, 2,2,2,1, ...) and tests/train/test_sequence_parallel.py (sp meshes).)


@pytest.fixture(scope="module")
def stages():
    return {stage: run(dims, zero_stage=stage, with_grads=True, shared_init=True) for stage, dims in MESH.items()}


@pytest.mark.parametrize("stage", list(MESH))
def test_memory_follows_the_zero_formula(stages, stage):
    r = stages[stage]
    m = state_memory(r["placement"], r["step"], r["grads"], r["batch"])
    psi, n = m["n_params"], m["data_devices"]
    assert n == 8
    want = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
    assert m["formula"]["total"] == pytest.approx(want)
    assert m["total"] == pytest.approx(want, rel=0.05), (stage, m)


def test_memory_falls_stage_by_stage(stages):
    totals = [state_memory(r["placement"], r["step"], r["grads"], r["batch"])["total"] for r in stages.values()]
    assert totals[0] > totals[1] > totals[2] > totals[3]


def _bytes_by_kind(r) -> dict:
    """Payload bytes per step of each collective kind over more than one device."""
    out = {}
    for c in collectives(r["step"].as_text(), r["placement"]):
        out[c.kind] = out.get(c.kind, 0) + c.total_bytes
    return out


def test_stage2_reduce_scatters_where_stage0_all_reduces(stages):
    grads = 4 * sum(np.prod(s.shape) for s in jax.tree.leaves(stages[0]["placement"].shapes))  # fp32 gradients
    zero0, zero2 = _bytes_by_kind(stages[0]), _bytes_by_kind(stages[2])
    assert zero0["all-reduce"] == pytest.approx(grads, rel=0.01) and "reduce-scatter" not in zero0
    assert zero2["reduce-scatter"] == pytest.approx(grads, rel=0.01)
    assert zero2.get("all-reduce", 0) < 0.01 * grads  # only scalars: the loss, token count, gradient norm
    text = stages[2]["step"].as_text()
    assert "reduce-scatter(" in text and "reduce-scatter(" not in stages[0]["step"].as_text()
    assert all(c.axes == ("dp",) for c in collectives(text, stages[2]["placement"]) if c.kind == "reduce-scatter")
    # meshlm.hlo reads the same instructions (it counts their scattered results: input / 8)
    assert (
        8 * sum(c.total_bytes for c in parse_collectives(text) if c.kind == "reduce-scatter") == zero2["reduce-scatter"]
    )


@pytest.mark.parametrize("stage", list(MESH))
def test_every_stage_trains_like_one_device(stages, reference_run, stage):
    np.testing.assert_allclose(stages[stage]["losses"], reference_run["losses"], rtol=1e-5)
    # the gradient norm (one reduction across devices, replicated gradients counted once) clips alike
    np.testing.assert_allclose(stages[stage]["grad_norms"], reference_run["grad_norms"], rtol=1e-5)


@pytest.mark.parametrize(
    "dims,accum",
    [
        ("2,1,1,4", 1),  # RingAttention over sp inside the shard_map over dp
        pytest.param("2,2,2,1", 2, marks=pytest.mark.slow),  # tensor parallel inside, gradient accumulation
    ],
)
def test_stage2_composes_with_model_parallel_axes(reference, dims, accum):
    r = run(dims, zero_stage=2, grad_accum=accum, shared_init=True)
    np.testing.assert_allclose(r["losses"], reference, rtol=1e-5)
    assert "reduce-scatter(" in r["step"].as_text()


def test_layouts_by_stage(stages):
    gate = lambda r, what: r["placement"].__dict__[what]["layers"]["mlp"]["gate"]  # noqa: E731
    assert str(gate(stages[0], "specs")) == str(gate(stages[0], "opt_specs")) == "P(None, None, None)"
    assert str(gate(stages[1], "opt_specs")) == "P(None, 'dp', None)"
    assert str(gate(stages[1], "grad_specs")) == "P(None, None, None)"
    assert str(gate(stages[2], "grad_specs")) == "P(None, 'dp', None)"
    assert str(gate(stages[3], "specs")) == "P(None, 'fsdp', None)"
    # the optimizer moments really live where the table says
    mu = stages[1]["state"].opt_state[1][0].mu["layers"]["mlp"]["gate"]
    assert str(mu.sharding.spec) == "P(None, 'dp', None)"


@pytest.mark.parametrize(
    "stage, sizes, refused",
    [
        (0, {"fsdp": 2, "pp": 2}, True),
        (2, {"dp": 2, "pp": 2}, True),
        (3, {"fsdp": 2, "pp": 2}, False),
        (None, {"fsdp": 2, "pp": 2}, False),
        (1, {"tp": 2, "pp": 2}, False),  # no data axis over 1 device
    ],
)
def test_stages_0_to_2_are_refused_with_a_pipeline(stage, sizes, refused):
    from meshlm.errors import UsageError
    from meshlm.strategy import check_pipelined, choose

    strategy, _ = choose("default", stage, None)
    check_pipelined(strategy, sizes, pipelined=False)
    if not refused:
        return check_pipelined(strategy, sizes, pipelined=True)
    with pytest.raises(UsageError, match=f"--zero_stage={stage} with --pp"):
        check_pipelined(strategy, sizes, pipelined=True)
