"""The cost model: the sharding guide's worked example, the operator table, and planning at scale."""

import time

import pytest

from meshlm.mesh import parse_mesh_dim
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.plan import search
from meshlm.plan.cost import min_compute_bound_shard, row_parallel_intensity
from meshlm.plan.hardware import CATALOG, resolve_hardware
from meshlm.plan.job import Job


def test_trillium_tensor_parallelism_is_compute_bound_only_above_5100():
    """MaxText's guide: on TPU v6e, B M_x @ M_x E → RS over x is compute-bound only when M/|x| > ~5,100."""
    v6e = CATALOG["tpu-v6e"]
    assert v6e.ridge_intensity == pytest.approx(918e12 / 180e9)
    assert 5000 <= min_compute_bound_shard(v6e) <= 5200
    for rows, e in ((8, 4096), (4096, 8192)):  # the batch and d_model cancel out
        assert row_parallel_intensity(rows, 5000, e) < v6e.ridge_intensity < row_parallel_intensity(rows, 5200, e)
    # The same matmul with an all-reduce sends twice the bytes: it needs twice the shard.
    assert min_compute_bound_shard(v6e, all_reduce=True) == pytest.approx(2 * min_compute_bound_shard(v6e), abs=2)


def _tp_plan(mlp_dim: int, tp: int):
    cfg = resolve_model(
        "test",
        {
            "d_model": "4096",
            "mlp_dim": str(mlp_dim),
            "n_heads": "32",
            "n_kv_heads": "16",
            "vocab_size": "32768",
            "max_seq_len": "4096",
        },
    )
    job = Job(cfg, 16, 2048, tp, policy=RunPolicy(dtype="bfloat16"))
    return search.evaluate(job, parse_mesh_dim(f"1,1,{tp},1", tp), resolve_hardware("tpu-v6e", tp))


def test_operator_table_puts_tensor_parallel_matmuls_against_the_trillium_ridge():
    ops = {M: {op.name: op for op in _tp_plan(M, 8).operators} for M in (8192, 65536)}
    narrow, wide = ops[8192]["mlp.down"], ops[65536]["mlp.down"]
    assert narrow.link == "ICI" and narrow.ridge == pytest.approx(5100)
    assert wide.intensity == pytest.approx(8 * narrow.intensity)  # intensity grows with M/|x|
    assert narrow.comm_bound and "less tp" in narrow.fix  # M/|x| = 1,024
    assert not wide.comm_bound  # M/|x| = 8,192
    assert narrow.notation == "B T M_tp @ M_tp E = B T E"  # the guide's notation; size-1 axes left out


@pytest.mark.parametrize("hardware", ["h100", "tpu-v5p"])
def test_70b_over_256_devices_is_planned_in_under_30_seconds(hardware):
    cfg = resolve_model("llama2-70b", {})
    job = Job(cfg, 256, 4096, 256, policy=RunPolicy(dtype="bfloat16", remat="full"))
    t0 = time.perf_counter()
    plans, rejected = search.search(job, resolve_hardware(hardware, 256))
    seconds = time.perf_counter() - t0
    assert seconds < 30, f"planning took {seconds:.1f} s"
    assert len(plans) >= 10 and plans[0].fits
    assert plans[0].shape.n_devices == 256
    assert all(p.time.step_s >= plans[0].time.step_s for p in plans if p.fits)
