"""`meshlm.sharding.lookup`: the token ids go to the embedding table, not the table to the ids.

On each mesh the looked-up rows and the table's gradient equal plain `jnp.take`'s on one device, and the
compiled program moves no table-sized buffer: no all-gather of the table, no reduction of its whole
gradient over the axes that split it.

`meshlm.sharding.global_norm`: the norm of a tree laid out on a mesh, whatever each leaf's layout (split,
partly split, whole), equals numpy's, with one reduction across devices for the whole tree.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshlm import axes, hlo, sharding
from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.strategy import DEFAULT, preset

V, E, B, T = 1024, 64, 8, 16


def run(mesh_dim: str, strategy=DEFAULT):
    mesh = build_mesh(parse_mesh_dim(mesh_dim, 8), jax.devices()[:8])
    table_spec = sharding.logical_to_spec(axes.EMBED_TABLE, strategy.params, mesh)
    rng = np.random.default_rng(0)
    table = jax.device_put(rng.normal(size=(V, E)).astype(np.float32), NamedSharding(mesh, table_spec))
    tokens = jax.device_put(rng.integers(0, V, (B, T)).astype(np.int32), sharding.batch_sharding(mesh, strategy))
    weights = rng.normal(size=(B, T, E)).astype(np.float32)

    def loss(table, tokens):
        with sharding.activate(mesh, strategy):
            rows = sharding.constrain(sharding.lookup(table, tokens), axes.STREAM)
        return jnp.sum(rows * weights), rows

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, rows), grad = step(table, tokens)
    text = step.lower(table, tokens).compile().as_text()
    return np.asarray(table), np.asarray(tokens), weights, np.asarray(rows), np.asarray(grad), text


@pytest.mark.parametrize("mesh_dim", ["1,8,1,1", "2,2,2,1", "1,2,1,4", "1,4,2,1"])
def test_lookup_equals_take_and_moves_rows_not_the_table(mesh_dim):
    table, tokens, weights, rows, grad, text = run(mesh_dim)
    np.testing.assert_array_equal(rows, table[tokens])
    expected = np.zeros_like(table)
    np.add.at(expected, tokens, weights)
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)
    # The table is V·E·4 = 256 KiB; the rows at most B·T·E·4 = 32 KiB, the ids 512 B. Only dp, which does not
    # split the table, may sum (its shard of) the table's gradient.
    dp = parse_mesh_dim(mesh_dim, 8).dp
    big = [
        c
        for c in hlo.parse_collectives(text)
        if c.payload_bytes >= V * E and not (c.kind == "all-reduce" and c.group_size == dp)
    ]
    assert not big, f"{mesh_dim}: table-sized collectives {big}"
    assert "all-to-all" in text


def test_a_table_axis_no_token_dimension_holds_keeps_the_table_gathered():
    # megatron keeps the table's embed dimension whole: nothing to send the ids to; plain take
    table, tokens, _, rows, _, text = run("2,1,4,1", preset("megatron"))
    np.testing.assert_array_equal(rows, table[tokens])
    assert "all-to-all" not in text


@pytest.mark.parametrize("mesh_dim", ["1,8,1,1", "2,2,2,1", "8,1,1,1"])
def test_global_norm_counts_every_element_once_in_one_reduction(mesh_dim):
    mesh = build_mesh(parse_mesh_dim(mesh_dim, 8), jax.devices()[:8])
    specs = {"split": P("fsdp", "tp"), "rows": P(("dp", "fsdp")), "tp": P(None, "tp"), "whole": P(), "scalar": P()}
    shapes = {"split": (16, 8), "rows": (32,), "tp": (3, 8), "whole": (5, 2), "scalar": ()}
    rng = np.random.default_rng(0)
    host = {k: rng.normal(size=shape).astype(np.float32) for k, shape in shapes.items()}
    tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    norm = jax.jit(lambda t: sharding.global_norm(t, mesh, specs))
    want = np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in host.values()))
    np.testing.assert_allclose(float(norm(tree)), want, rtol=1e-6)
    reductions = [c for c in hlo.parse_collectives(norm.lower(tree).compile().as_text()) if c.group_size > 1]
    assert [c.kind for c in reductions] == ["all-reduce"], reductions
    # the same value on one device, and inside no mesh at all
    one = build_mesh(parse_mesh_dim("1,1,1,1", 1), jax.devices()[:1])
    np.testing.assert_allclose(float(sharding.global_norm(host, one, specs)), want, rtol=1e-6)


def test_splits_over_names_a_split_on_any_of_the_axes():
    specs = {"a": P(None, ("dp", "fsdp")), "b": P("tp"), "c": P()}
    assert sharding.splits_over(specs, ("fsdp",)) and sharding.splits_over(specs, ("tp", "sp"))
    assert not sharding.splits_over(specs, ("sp",)) and not sharding.splits_over({"c": P()}, ("dp",))


# ------------------------------------------------------------------------------------ spec helpers


def test_filter_axes_gives_one_spec_entry():
    assert sharding.filter_axes(("dp", "fsdp", "sp"), drop={"fsdp"}) == ("dp", "sp")
    assert sharding.filter_axes(("dp", "fsdp"), only=("fsdp", "tp")) == "fsdp"
    assert sharding.filter_axes("tp", drop=("tp",)) is None
    assert sharding.filter_axes(["fsdp"]) == "fsdp" and sharding.filter_axes(None) is None
    assert sharding.filter_spec(P(("dp", "fsdp"), None, "tp"), only=("dp", "fsdp")) == P(("dp", "fsdp"), None, None)
    local = sharding.without_axes(DEFAULT, ("dp", "fsdp"))
    assert sharding.as_tuple(local.activations["batch"]) == () and local.params == DEFAULT.params


def test_micro_batches_keep_each_data_shard_s_rows():
    """Micro-batch i holds rows i, i+n, ...; laid out on a mesh, each one's rows stay split as the batch's."""
    batch = {"inputs": np.arange(8 * 3).reshape(8, 3)}
    micro = sharding.micro_batches(batch, 2)["inputs"]
    np.testing.assert_array_equal(micro[1], batch["inputs"][1::2])
    mesh = build_mesh(parse_mesh_dim("1,8,1,1", 8), jax.devices()[:8])
    stacked = jax.jit(lambda b: sharding.micro_batches(b, 2, mesh, DEFAULT))({"inputs": jnp.zeros((16, 4), jnp.int32)})[
        "inputs"
    ]
    assert stacked.shape == (2, 8, 4) and tuple(stacked.sharding.spec)[:2] == (None, "fsdp")
