"""Every preset is one table, documented in one place, and trains like one device."""

from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshlm.strategy import DEFAULT, PRESETS, presets
from tests.support.training import run_strategy as run

ROOT = Path(__file__).resolve().parents[2]

# preset -> (mesh, the spec of layers/mlp/gate [L, E, M] it must give there)
CASES = {
    "dp": ("2,2,2,1", P(None, None, None)),
    "fsdp": ("2,2,2,1", P(None, ("dp", "fsdp", "tp"), None)),
    "fsdp_tp": ("2,2,2,1", P(None, ("dp", "fsdp"), "tp")),
    "megatron": ("2,2,2,1", P(None, None, "tp")),
    "megatron_sp": ("2,1,4,1", P(None, None, "tp")),
    "fsdp_sp": ("1,2,1,4", P(None, ("fsdp", "sp"), None)),
}


def test_every_preset_is_tested_and_documented():
    assert set(CASES) | {"default"} == set(PRESETS) and PRESETS["default"] is DEFAULT
    doc = (ROOT / "docs" / "strategies.md").read_text()
    for name, s in PRESETS.items():
        assert f"    {name} " in presets.__doc__, name  # the table in presets.py
        assert f"`{name}`" in doc, name
        assert s.doc, name


@pytest.fixture(scope="module")
def runs():
    """Each preset trained from the one-device initial state laid out as the preset lays it out (shared_init,
    as in test_zero.py: a preset moves where a fresh state's values live, not what they are)."""
    return {name: run(dims, name, shared_init=True) for name, (dims, _) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_preset_trains_like_one_device(runs, reference, name):
    np.testing.assert_allclose(runs[name]["losses"], reference, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_preset_layout(runs, name):
    placement = runs[name]["placement"]
    assert placement.specs["layers"]["mlp"]["gate"] == CASES[name][1]
    assert runs[name]["state"].params["layers"]["mlp"]["gate"].sharding.spec == CASES[name][1]


def test_megatron_sp_splits_the_sequence_between_tensor_parallel_regions(runs):
    from meshlm import axes, sharding

    r = runs["megatron_sp"]
    placement = r["placement"]
    assert sharding.batch_sharding(placement.mesh, placement.strategy).spec == P("dp", "tp")
    assert sharding.data_parallel_size(placement.mesh, placement.strategy) == 2  # rows over dp only
    assert sharding.sequence_parallel_size(placement.mesh, placement.strategy) == 1  # a shared length never rings
    with sharding.activate(placement.mesh, placement.strategy):
        assert sharding.activation_spec(axes.STREAM) == P("dp", "tp", None)  # residual
        assert sharding.activation_spec(axes.QUERIES) == P("dp", None, "tp", None)
        assert sharding.ring_spec() is None  # no RingAttention: attention sees the whole sequence
