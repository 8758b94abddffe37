"""tp larger than a grouped-query model's kv heads: the key/value projections stay whole on every tp
rank and each rank repeats the kv head its queries use; training and decoding give what one device gives."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm import sharding
from meshlm.mesh import MeshShape, check_shape_fits
from meshlm.strategy import choose
from tests.support.training import CFG, make_batches, run

GQA = CFG.replace(n_heads=8, n_kv_heads=2)
MESHES = ["1,1,1,1", "2,1,4,1", "1,2,4,1", "1,1,8,1"]


@pytest.fixture(scope="module")
def runs():
    """Every mesh starts from the state made on one device (shared_init): which values a fresh state holds
    on a mesh is tests/train/test_train_step.py's; here, what a step does with kv heads copied over tp."""
    batches = make_batches(GQA)
    return {dims: run(dims, cfg=GQA, batches=batches, shared_init=True) for dims in MESHES}


@pytest.mark.parametrize("dims", MESHES[1:])
def test_training_with_more_tp_ranks_than_kv_heads_matches_one_device(runs, dims):
    np.testing.assert_allclose(runs[dims]["losses"], runs["1,1,1,1"]["losses"], rtol=1e-5)
    got, want = jax.device_get(runs[dims]["state"].params), jax.device_get(runs["1,1,1,1"]["state"].params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_kv_projections_are_whole_and_queries_split(runs):
    shardings = runs["2,1,4,1"]["placement"].shardings
    attn = shardings["layers"]["attn"]
    assert attn["wk"].spec == P() or all(e is None for e in attn["wk"].spec), attn["wk"].spec
    assert attn["wq"].spec[2] == "tp", attn["wq"].spec


@pytest.mark.parametrize(
    "tp, kv, heads, copies", [(4, 2, 8, 2), (8, 2, 8, 4), (4, 4, 8, 1), (6, 4, 12, 3), (8, 1, 8, 8)]
)
def test_copies_are_the_fewest_that_split_evenly(tp, kv, heads, copies):
    from jax.sharding import AbstractMesh

    strategy, _ = choose("default", None, None)
    mesh = AbstractMesh((1, 1, tp, 1), ("dp", "fsdp", "tp", "sp"))
    with sharding.activate(mesh, strategy):
        assert sharding.kv_head_copies(kv, heads) == copies
    assert sharding.kv_head_copies(kv, heads) == 1  # outside a layout nothing is repeated


def test_the_mesh_check_no_longer_refuses_tp_above_kv_heads():
    job = dict(batch_size=8, seq_len=32, n_heads=8, n_kv_heads=2, mlp_dim=128, vocab_size=512)
    assert check_shape_fits(MeshShape(1, 1, 4, 1), **job) is None
    assert "n_heads" in check_shape_fits(MeshShape(1, 1, 16, 1), **{**job, "batch_size": 16})
