"""Training with the sequence split over sp (RingAttention, zigzag order) gives the losses of one device."""

import numpy as np
import pytest

from meshlm.errors import UsageError
from meshlm.mesh import MeshShape, validate_mesh_shape
from meshlm.ops.ring import zigzag_permutation
from tests.support.training import run


@pytest.fixture(scope="module")
def reference():
    return run("1,1,1,1")["losses"]


@pytest.mark.parametrize("dims", ["1,1,1,8", "1,1,2,4", "2,1,2,2"])
def test_ring_training_matches_one_device(reference, dims):
    np.testing.assert_allclose(run(dims)["losses"], reference, rtol=1e-5)


def test_zigzag_order_is_a_balanced_permutation():
    perm = zigzag_permutation(32, 4)
    assert sorted(perm) == list(range(32))
    shards = perm.reshape(4, 8)
    # shard r holds chunk r and chunk 2*sp-1-r: the causal work (sum of positions) is the same on every rank
    work = [int(np.sum(s + 1)) for s in shards]
    assert len(set(work)) == 1, work


def test_seq_len_must_split_into_two_chunks_per_ring_rank():
    job = dict(batch_size=8, n_heads=8, n_kv_heads=8, mlp_dim=128, vocab_size=512)
    validate_mesh_shape(MeshShape(1, 1, 1, 8), seq_len=64, **job)
    with pytest.raises(UsageError, match="seq_len 40 is not divisible by 2×sp = 16"):
        validate_mesh_shape(MeshShape(1, 1, 1, 8), seq_len=40, **job)
