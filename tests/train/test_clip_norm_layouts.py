"""The optimizer state has one layout whatever --clip_norm is, and a checkpoint saved in the layout that
--clip_norm=0 used to write (AdamW's state alone, no clip in front) still resumes."""

import jax
import numpy as np
import optax
import pytest

from meshlm.checkpoint.manager import Checkpointer
from meshlm.optimizer import OptimizerConfig, make_optimizer
from meshlm.train.state import abstract_state, create_train_state, earlier_layouts


@pytest.fixture(scope="module")
def placement():
    from meshlm import job as joblib
    from meshlm.config import TrainConfig

    cfg = TrainConfig(model="test", dataset="synthetic", batch_size=8, seq_len=32, dtype="float32", mesh_dim="1,8,1,1")
    return joblib.resolve(cfg, output=False).placement


@pytest.fixture(scope="module")
def state(placement):
    return create_train_state(placement, make_optimizer(OptimizerConfig(clip_norm=0.0)))


def saved(directory, state):
    ckpt = Checkpointer(directory)
    ckpt.save(1, state, {}, {})
    ckpt.close()
    return directory


def restore(directory, placement, clip_norm):
    target = abstract_state(placement, make_optimizer(OptimizerConfig(clip_norm=clip_norm)))
    return Checkpointer(directory).restore(target, earlier_layouts=earlier_layouts(target))[0]


def test_a_checkpoint_resumes_with_another_clip_norm(placement, state, tmp_path):
    directory = saved(tmp_path, state)  # saved with --clip_norm=0
    for clip_norm in (1.0, 0.0):
        got = restore(directory, placement, clip_norm)
        assert jax.tree.structure(got) == jax.tree.structure(state)
        jax.tree.map(np.testing.assert_array_equal, got, state)


def test_the_layout_clip_norm_0_used_to_save_resumes(placement, state, tmp_path):
    directory = saved(tmp_path, state._replace(opt_state=state.opt_state[1]))  # AdamW's state alone
    got = restore(directory, placement, clip_norm=0.0)
    assert isinstance(got.opt_state[0], optax.EmptyState)
    jax.tree.map(np.testing.assert_array_equal, got, state)
