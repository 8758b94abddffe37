"""The MoE math against a plain per-expert loop, transformers' load-balancing loss and Mixtral's block."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlm.ops.moe import (
    expert_capacity,
    load_balancing_loss,
    moe_mlp,
    positions_in_expert,
    route,
    router_z_loss,
)

N, E, M = 24, 8, 12


def make_weights(num_experts, seed=0, n=N, e=E, m=M, scale=0.5):
    """x [n, e], router_w [e, X], w_gate and w_up [X, e, m], w_down [X, m, e], float32."""
    keys = jax.random.split(jax.random.key(seed), 5)
    shapes = [(n, e), (e, num_experts), (num_experts, e, m), (num_experts, e, m), (num_experts, m, e)]
    return [scale * jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes, strict=True)]


def reference_moe(x, router_w, w_gate, w_up, w_down, *, k, renormalize, keep=None):
    """Every expert on every token, masked to its chosen ones: y [N, E]. keep [N, k] drops choices."""
    probs = jax.nn.softmax(x @ router_w, axis=-1)
    experts = jnp.argsort(-probs, axis=-1, stable=True)[:, :k]
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    if keep is not None:
        weights = jnp.where(keep, weights, 0.0)
    y = jnp.zeros_like(x)
    for e in range(router_w.shape[1]):
        weight_e = jnp.sum(jnp.where(experts == e, weights, 0.0), axis=1)
        hidden = jax.nn.silu(x @ w_gate[e]) * (x @ w_up[e])
        y = y + weight_e[:, None] * (hidden @ w_down[e])
    return y


def value_and_grads(fn, args, dy):
    """(y, grads of sum(y * dy) with respect to all five arguments)."""
    y = fn(*args)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a) * dy), argnums=tuple(range(5)))(*args)
    return y, grads


@functools.cache
def compiled(k, renormalize, capacity_factor=None):
    """jit of (args, dy) -> (y, grads, aux) for `moe_mlp`; shared by the cases with these settings."""
    kw = dict(k=k, renormalize=renormalize, capacity_factor=capacity_factor)

    def run(args, dy):
        y, grads = value_and_grads(lambda *a: moe_mlp(*a, **kw)[0], args, dy)
        return y, grads, moe_mlp(*args, **kw)[1]

    return jax.jit(run)


@functools.cache
def jitted_moe(k, renormalize):
    return jax.jit(functools.partial(moe_mlp, k=k, renormalize=renormalize))


@functools.cache
def compiled_reference(k, renormalize):
    """jit of (args, dy, keep) -> (y, grads) for the per-expert loop."""
    return jax.jit(lambda args, dy, keep: value_and_grads(
        functools.partial(reference_moe, k=k, renormalize=renormalize, keep=keep), args, dy))  # fmt: skip


def kept_by_count(experts: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """[N, k] bool: walk the choices token by token, each expert taking its first `capacity`."""
    taken = np.zeros(num_experts, int)
    keep = np.zeros(experts.shape, bool)
    for t, choices in enumerate(experts):
        for j, e in enumerate(choices):
            keep[t, j] = taken[e] < capacity
            taken[e] += 1
    return keep


def assert_close_tree(got, want, atol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=1e-5)


def test_route_softmax_top_k():
    logits = jax.random.normal(jax.random.key(1), (10, 6)) * 3
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for renormalize in (False, True):
        weights, experts = route(logits.astype(jnp.bfloat16), 2, renormalize=renormalize)
        assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
        want_experts = np.argsort(-np.asarray(jax.nn.softmax(logits.astype(jnp.bfloat16).astype(jnp.float32))), 1)
        np.testing.assert_array_equal(np.asarray(experts), want_experts[:, :2])
        weights, experts = route(logits, 2, renormalize=renormalize)
        want = np.take_along_axis(probs, np.asarray(experts), 1)
        want = want / want.sum(1, keepdims=True) if renormalize else want
        np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6)


@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("renormalize", [True, False])
def test_dropless_equals_reference(num_experts, k, renormalize):
    args = make_weights(num_experts, seed=num_experts + k)
    dy = jax.random.normal(jax.random.key(7), (N, E))
    *got, aux = compiled(k, renormalize)(args, dy)
    want = compiled_reference(k, renormalize)(args, dy, None)
    assert float(jnp.abs(got[0]).max()) > 1e-2  # the experts contribute
    assert_close_tree(got, want)
    assert float(aux["dropped_fraction"]) == 0.0
    assert float(aux["load"].sum()) == N * k


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_drops_what_an_independent_count_drops(k):
    num_experts, factor = 4, 1.0
    args = make_weights(num_experts, seed=3)
    args[1] = args[1].at[:, 0].add(1.0)  # an unbalanced router: expert 0 overflows
    capacity = expert_capacity(factor, N, k, num_experts)
    probs = np.asarray(jax.nn.softmax(args[0] @ args[1], -1))
    keep = kept_by_count(np.argsort(-probs, 1, kind="stable")[:, :k], num_experts, capacity)
    assert 0 < (~keep).sum()
    dy = jax.random.normal(jax.random.key(8), (N, E))
    *got, aux = compiled(k, True, factor)(args, dy)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), (~keep).sum() / keep.size, rtol=1e-6)
    want = compiled_reference(k, True)(args, dy, jnp.asarray(keep))
    assert_close_tree(got, want)


def test_positions_in_expert_counts_earlier_same_expert_entries():
    ids = jnp.array([2, 0, 2, 1, 2, 0], jnp.int32)
    np.testing.assert_array_equal(np.asarray(positions_in_expert(ids, 3)), [0, 0, 1, 0, 2, 1])


def transformers_balance_loss(logits, num_experts, k, mask=None):
    torch = pytest.importorskip("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    attention = None if mask is None else torch.tensor(np.asarray(mask)).reshape(2, -1)
    loss = load_balancing_loss_func((torch.tensor(np.asarray(logits)),), num_experts, k, attention)
    return float(loss)


@pytest.mark.parametrize("k", [1, 2])
def test_aux_losses_equal_transformers_and_the_z_formula(k):
    num_experts = 8
    x, router_w, *experts_w = make_weights(num_experts, seed=11, scale=1.0)
    logits = np.asarray(x @ router_w)
    mask = (np.arange(N) % 5 != 4).astype(np.float32)
    _, chosen = route(jnp.asarray(logits), k, renormalize=False)
    for m in (None, mask):
        want = transformers_balance_loss(logits, num_experts, k, m)
        got = load_balancing_loss(jnp.asarray(logits), chosen, num_experts, k, mask=m)
        np.testing.assert_allclose(float(got), want, rtol=1e-5)
        _, aux = jitted_moe(k, True)(x, router_w, *experts_w, mask=m)
        np.testing.assert_allclose(float(aux["load_balancing_loss"]), want, rtol=1e-5)
        keep = np.ones(N) if m is None else m
        lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
        want_z = (keep * lse**2).sum() / keep.sum()
        np.testing.assert_allclose(float(router_z_loss(jnp.asarray(logits), mask=m)), want_z, rtol=1e-5)
        np.testing.assert_allclose(float(aux["z_loss"]), want_z, rtol=1e-5)


def test_mask_keeps_padding_out_of_the_experts():
    args = make_weights(4, seed=5)
    mask = (np.arange(N) % 3 != 0).astype(np.float32)
    y, aux = jitted_moe(2, True)(*args, mask=mask)
    want = compiled_reference(2, True)(args, jnp.zeros((N, E)), None)[0]
    np.testing.assert_allclose(np.asarray(y)[mask == 1], np.asarray(want)[mask == 1], atol=1e-5)
    assert not np.asarray(y)[mask == 0].any()
    assert float(aux["load"].sum()) == 2 * mask.sum()


def sparse_moe_block(family: str, renormalize: bool):
    """A tiny transformers MoE block (hidden 16, experts' hidden 32, 4 experts, top 2), random weights."""
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    shape = dict(hidden_size=16, num_experts_per_tok=2)
    if family == "mixtral":
        block = MixtralSparseMoeBlock(transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **shape))
    else:
        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=32, num_experts=4, norm_topk_prob=renormalize, **shape
        )
        block = Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block.eval()


@pytest.mark.parametrize("family, renormalize", [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_transformers_sparse_moe_block(family, renormalize):
    torch = pytest.importorskip("torch")
    block = sparse_moe_block(family, renormalize)
    hidden = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = block(hidden).numpy()
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [X, 2M, E]: gate rows, then up rows
    down = block.experts.down_proj.detach().numpy()  # [X, E, M]
    w_gate, w_up = gate_up[:, :32].transpose(0, 2, 1), gate_up[:, 32:].transpose(0, 2, 1)
    router_w = block.gate.weight.detach().numpy().T  # [E, X]
    x = hidden.numpy().reshape(10, 16)
    y, _ = jitted_moe(2, renormalize)(x, router_w, w_gate, w_up, down.transpose(0, 2, 1))
    assert np.abs(want).max() > 1e-2
    np.testing.assert_allclose(np.asarray(y).reshape(2, 5, 16), want, atol=1e-5)


def test_bfloat16_runs_in_bfloat16_and_matches_float32_on_the_same_values():
    args = [a.astype(jnp.bfloat16) for a in make_weights(4, seed=9)]
    y, aux = jitted_moe(2, True)(*args)
    want, _ = jitted_moe(2, True)(*[a.astype(jnp.float32) for a in args])
    assert y.dtype == jnp.bfloat16 and aux["load_balancing_loss"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
