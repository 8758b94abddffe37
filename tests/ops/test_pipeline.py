"""Pipeline schedules: the static tables, and loss + gradients equal to running the stages in order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm.errors import UsageError
from meshlm.ops.pipeline import BWD, FWD, build_schedule, check, pipeline_value_and_grad

D, LAYERS_PER_STAGE = 16, 2


def layer(w, x):
    return x + jnp.tanh(x @ w["a"]) @ w["b"]


def stage_fn(p, x, _side=None):  # p: leaves [LAYERS_PER_STAGE, ...]
    x, _ = jax.lax.scan(lambda h, w: (layer(w, h), None), x, p)
    return x


def make_head_fn(M):
    def head_fn(hp, x, y):
        return jnp.mean((x @ hp["w"] - y) ** 2) / M

    return head_fn


def init(S, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    layers = {
        "a": jax.random.normal(k[0], (S, LAYERS_PER_STAGE, D, D)) * 0.3,
        "b": jax.random.normal(k[1], (S, LAYERS_PER_STAGE, D, D)) * 0.3,
    }
    head = {"w": jax.random.normal(k[2], (D, 4)) * 0.3}
    return layers, head


def reference(layers, head, x, y):
    head_fn = make_head_fn(x.shape[0])

    def loss(layers, head, x):
        def one(x_i, y_i):
            h, _ = jax.lax.scan(lambda h, p: (stage_fn(p, h), None), x_i, layers)
            return head_fn(head, h, y_i)

        return jnp.sum(jax.vmap(one)(x, y))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(layers, head, x)


def to_ranks(tree, pp, V):
    """[S, ...] stages -> [pp, V, ...]: stage k = v·pp + r at [r, v]."""
    return jax.tree.map(lambda a: a.reshape(V, pp, *a.shape[1:]).swapaxes(0, 1), tree)


def from_ranks(tree, pp, V):
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(pp * V, *a.shape[2:]), tree)


@pytest.mark.parametrize(
    "name, pp, M, V",
    [
        ("gpipe", 2, 4, 1),
        ("1f1b", 2, 4, 1),
        ("1f1b", 4, 5, 1),
        ("interleaved", 2, 4, 2),
        ("gpipe", 4, 8, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved", 4, 8, 2),
    ],
)
def test_loss_and_gradients_equal_the_stages_in_order(name, pp, M, V):
    S = pp * V
    layers, head = init(S)
    x = jax.random.normal(jax.random.key(1), (M, 8, 3, D))  # [M, rows, length, D]
    y = jax.random.normal(jax.random.key(2), (M, 8, 3, 4))
    want_loss, (g_layers, g_head, g_x) = reference(layers, head, x, y)

    mesh = jax.make_mesh((pp, 8 // pp), ("pp", "data"), axis_types=(AxisType.Auto,) * 2)
    schedule = build_schedule(name, pp, M, V)
    staged = jax.device_put(to_ranks(layers, pp, V), NamedSharding(mesh, P("pp")))
    scale = jnp.ones((D,))  # the "embedding": x_i * scale, so d scale = sum_i x_i * d x_i

    def first_fn(sc, s):
        return s["x"] * sc

    def head_fn(hp, x, s):
        return make_head_fn(M)(hp, x, s["y"])

    run = jax.jit(
        lambda sc, st, h, side: pipeline_value_and_grad(first_fn, stage_fn, head_fn, sc, st, h, side, schedule, mesh)
    )
    loss, (got_scale, g_staged, got_head) = run(scale, staged, head, {"x": x, "y": y})

    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    got_layers = from_ranks(g_staged, pp, V)
    for key in ("a", "b"):
        close(got_layers[key], g_layers[key])
    close(got_head["w"], g_head["w"])
    close(got_scale, jnp.sum(x * g_x, axis=(0, 1, 2)))


def close(got, want):
    """rtol 1e-4, and atol against the tensor's scale: JAX 0.12's XLA:CPU sums in another order (8e-6 off
    on entries near 0.004 of a tensor reaching 1.8, for the interleaved schedule)."""
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(np.asarray(want)).max()))


@pytest.mark.parametrize("name, V", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_every_stage_runs_each_microbatch_forward_then_backward_once(name, V):
    pp, M = 4, 8
    s = build_schedule(name, pp, M, V)
    seen = {}
    for t in range(s.clocks):
        for r in range(pp):
            for kind, row in ((FWD, s.fwd[t, r]), (BWD, s.bwd[t, r])):
                active, k, i = row[:3]
                if not active:
                    continue
                assert k % pp == r, "a stage ran on the wrong rank"
                assert s.kinds[t] & kind
                seen.setdefault((kind, k, i), []).append(t)
    S = pp * V
    for k in range(S):
        for i in range(M):
            [f], [b] = seen[(FWD, k, i)], seen[(BWD, k, i)]
            assert f < b
            if k > 0:
                assert seen[(FWD, k - 1, i)][0] < f  # its input came from the stage before
            if k < S - 1:
                assert seen[(BWD, k + 1, i)][0] < b  # its cotangent came from the stage after


def test_bubbles_match_theory_and_1f1b_keeps_memory_flat():
    for M in (4, 8, 16):
        g, f = build_schedule("gpipe", 4, M), build_schedule("1f1b", 4, M)
        assert g.bubble() == pytest.approx(g.theoretical_bubble()) == pytest.approx(3 / (M + 3))
        assert f.bubble() == pytest.approx(f.theoretical_bubble())
        assert g.act_slots == M and f.act_slots <= min(M, 2 * 4)  # 1F1B: at most 2·pp inputs stashed
    assert build_schedule("1f1b", 4, 8).act_slots == build_schedule("1f1b", 4, 16).act_slots
    i = build_schedule("interleaved", 4, 16, 2)
    assert i.bubble() == pytest.approx(3 / (32 + 3))
    assert i.bubble() < build_schedule("1f1b", 4, 16).bubble()


@pytest.mark.parametrize(
    "args, words",
    [
        (("zigzag", 2, 4, 1), "--pipeline_schedule=zigzag"),
        (("1f1b", 4, 2, 1), "--microbatches=2 is fewer than the --pp=4"),
        (("1f1b", 2, 4, 2), "--virtual_stages=2 needs --pipeline_schedule=interleaved"),
    ],
)
def test_bad_pipeline_flags(args, words):
    with pytest.raises(UsageError, match=words):
        check(*args)
    with pytest.raises(UsageError, match="do not split into --pp=4 × --virtual_stages=2"):
        check("interleaved", 4, 8, 2, n_layers=12)
