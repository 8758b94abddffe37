"""`meshlm train --pp`: the losses of the run without a pipeline, bounded memory with 1F1B, and
checkpoints that move between pipeline sizes."""

import functools
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlm.errors import UsageError
from meshlm.mesh import build_mesh, parse_mesh_dim
from meshlm.models.placement import place
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.ops.pipeline import build_schedule
from meshlm.optimizer import OptimizerConfig, make_optimizer
from meshlm.train.loop import TrainConfig, train
from meshlm.train.state import abstract_state
from meshlm.train.step import BATCH_KEYS, make_train_step

BASE = dict(
    model="test",
    model_overrides={"n_layers": "4"},
    dataset="synthetic",
    batch_size=8,
    seq_len=32,
    log_every=1,
    lr=1e-2,
    warmup_steps=0,
    min_lr_ratio=1.0,
    dtype="float32",
    peak_tflops=1.0,
)


def run(out, **kw) -> dict[int, float]:
    train(TrainConfig(**{**BASE, "output_dir": str(out), **kw}))
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plain"), mesh_dim="1,8,1,1", steps=3)


# pp=2 GPipe on 1,1,4,1 (default microbatches) is checked, for its first 2 steps, by the checkpoint test
# below: one compile of that job serves both.
@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        dict(pp=2, mesh_dim="1,2,2,1", pipeline_schedule="1f1b", microbatches=4),
        dict(pp=2, mesh_dim="2,1,2,1", pipeline_schedule="1f1b", microbatches=2),
        dict(pp=2, mesh_dim="1,1,2,2", pipeline_schedule="interleaved", virtual_stages=2, microbatches=4),
        dict(pp=4, mesh_dim="1,2,1,1", pipeline_schedule="1f1b", microbatches=4),
        dict(pp=4, mesh_dim="1,1,2,1", pipeline_schedule="gpipe", microbatches=8),
    ],
    ids=lambda f: f"pp{f['pp']}-{f['pipeline_schedule']}-{f['mesh_dim']}",
)
def test_pipelined_training_gives_the_losses_without_a_pipeline(plain, tmp_path, flags):
    got = run(tmp_path, steps=3, **flags)
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [plain[s] for s in (1, 2, 3)], rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_saved_with_pp_2_continues_with_pp_1(plain, tmp_path):
    """Saved by pp=2 GPipe with tp=4 (whose 2 steps give the losses without a pipeline), resumed on fsdp=8."""
    got = run(tmp_path, pp=2, mesh_dim="1,1,4,1", pipeline_schedule="gpipe", steps=2)
    np.testing.assert_allclose([got[s] for s in (1, 2)], [plain[s] for s in (1, 2)], rtol=1e-5)
    got = run(tmp_path, mesh_dim="1,8,1,1", steps=3)
    np.testing.assert_allclose(got[3], plain[3], rtol=1e-5)


def compiled(schedule_name: str, M: int, pp: int = 4, mesh_dim: str = "1,1,1,1", rows: int = 2):
    """The compiled train step on pp × mesh_dim simulated devices, `rows` rows per microbatch."""
    cfg = resolve_model(
        "test", {"n_layers": "4", "d_model": "256", "n_heads": "4", "n_kv_heads": "4", "mlp_dim": "256"}
    )
    n = pp * int(np.prod([int(a) for a in mesh_dim.split(",")]))
    mesh = build_mesh(parse_mesh_dim(mesh_dim, n, pp=pp), jax.devices()[:n])
    placement = place(cfg, mesh, policy=RunPolicy(dtype="float32"))
    optimizer = make_optimizer(OptimizerConfig())
    step = make_train_step(placement, optimizer, pipeline=build_schedule(schedule_name, pp, M))
    batch = {k: jax.ShapeDtypeStruct((rows * M, 64), np.float32 if k == "loss_mask" else np.int32) for k in BATCH_KEYS}
    return step.lower(abstract_state(placement, optimizer), batch).compile()


def temp_bytes(schedule_name: str, M: int) -> int:
    """Compiled per-device temporary memory of the pp=4 train step, 2 rows per microbatch."""
    return compiled(schedule_name, M).memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_1f1b_memory_stays_flat_as_microbatches_double_and_gpipe_grows():
    f8, f16 = temp_bytes("1f1b", 8), temp_bytes("1f1b", 16)
    g8, g16 = temp_bytes("gpipe", 8), temp_bytes("gpipe", 16)
    assert f16 <= 1.10 * f8, (f8, f16)  # 1F1B: the stash holds at most 2·pp microbatches, whatever M is
    assert g16 >= 1.05 * g8 and g16 - g8 > 10 * max(f16 - f8, 1), (g8, g16, f8, f16)  # GPipe: all M of them


@pytest.mark.slow
@pytest.mark.parametrize("mesh_dim", ["4,1,1,1", "1,2,2,1", "1,1,1,4"])
def test_the_other_axes_split_each_stage_s_work(mesh_dim):
    """Within a stage, dp/fsdp split the microbatch rows, sp the sequence and tp the heads: a device
    on a 4-device stage does about a quarter of the arithmetic of a 1-device stage."""
    alone, shared = stage_flops("1,1,1,1"), stage_flops(mesh_dim)
    assert shared <= 0.3 * alone, (mesh_dim, shared / alone)


@functools.cache
def stage_flops(mesh_dim: str) -> float:
    return compiled("1f1b", 4, pp=2, mesh_dim=mesh_dim, rows=4).cost_analysis()["flops"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (dict(pp=2, mesh_dim="1,2,2,1", microbatches=1), "--microbatches=1 is fewer than the --pp=2"),
        (dict(pp=4, mesh_dim="1,2,1,1", pipeline_schedule="interleaved", virtual_stages=2), "do not split into --pp=4"),
        (dict(pp=2, mesh_dim="1,4,1,1", microbatches=4), "does not split into --microbatches=4"),
        (dict(pp=2, mesh_dim="1,2,2,1", grad_accum=2), "drop --grad_accum"),
        (dict(pp=2, mesh_dim="1,2,2,1", pipeline_schedule="zigzag"), "--pipeline_schedule=zigzag"),
        (dict(pp=3, mesh_dim="1,-1,1,1"), "--pp=3 does not divide the 8 devices"),
    ],
)
def test_bad_pipeline_flags_are_one_line(tmp_path, flags, words):
    with pytest.raises(UsageError, match=words):
        run(tmp_path, steps=1, **flags)
