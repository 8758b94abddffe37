"""`meshlm explain --pp`: the stage layout, per-stage memory, the schedule and its bubble, and the stage
transfers, each checked against the schedule table and the compiled HLO. One compile per configuration."""

import io
import math

import numpy as np
import pytest

from meshlm.cli import main
from meshlm.cli.explain import print_report
from meshlm.config import TrainConfig
from meshlm.explain.report import compile_step, explain
from meshlm.hlo import parse_collectives
from meshlm.job import resolve
from meshlm.ops.pipeline import BWD, FWD, build_schedule
from tests.support.cli import meshlm

BASE = dict(model="test", model_overrides={"n_layers": "4"}, batch_size=8, seq_len=32, dtype="float32")
CASES = {
    "pp2-1f1b": dict(pp=2, mesh_dim="1,2,2,1", pipeline_schedule="1f1b", microbatches=4),
    "pp4-gpipe": dict(pp=4, mesh_dim="1,2,1,1", pipeline_schedule="gpipe", microbatches=4),
    "pp2-interleaved": dict(
        pp=2, mesh_dim="1,1,4,1", pipeline_schedule="interleaved", virtual_stages=2, microbatches=4
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    flags = CASES[request.param]
    cfg = TrainConfig(**BASE, **flags)
    job = resolve(cfg)
    compiled = compile_step(job, cfg)
    report = explain(cfg, job=job, compiled=compiled)
    text = io.StringIO()
    print_report(report, file=text)
    return dict(
        flags=flags,
        report=report,
        text=text.getvalue(),
        placement=job.placement,
        step=compiled.step,
        batch=compiled.batch,
        schedule=job.pipeline,
    )


def test_stage_layout(case):
    pp, V = case["flags"]["pp"], case["flags"].get("virtual_stages", 1)
    S, per_rank = pp * V, 4 // pp
    stages = case["report"]["pipeline"]["stages"]
    assert [r["rank"] for r in stages] == list(range(pp))
    assert sorted(d for r in stages for d in r["devices"]) == list(range(8))  # each device in one stage
    for r in stages:
        lo = r["rank"] * per_rank
        assert r["layers_stored"] == (f"{lo}-{lo + per_rank - 1}" if per_rank > 1 else f"{lo}")
        assert [x["stage"] for x in r["stages"]] == [v * pp + r["rank"] for v in range(V)]
        assert "replicated over pp" in r["embed"] and "replicated over pp" in r["head"]
    assert "stage 0's input" in stages[0]["embed"] and f"stage {S - 1}'s head" in stages[(S - 1) % pp]["head"]
    specs = {p["path"]: p["spec"] for p in case["report"]["parameters"]}
    assert specs["layers/mlp/gate"].startswith("P('pp'") and "pp" not in specs["embed"] + specs["lm_head"]
    assert "pipeline stages:" in case["text"] and "layers stored" in case["text"]


def test_bubble_and_picture_are_the_schedule_tables(case):
    f = case["flags"]
    s = build_schedule(f["pipeline_schedule"], f["pp"], f["microbatches"], f.get("virtual_stages", 1))
    got = case["report"]["pipeline"]["schedule"]
    assert got["bubble"] == s.bubble() and got["theoretical_bubble"] == s.theoretical_bubble()
    assert got["bubble"] == pytest.approx((s.pp - 1) / (s.microbatches * s.virtual + s.pp - 1))
    assert got["clocks"] == s.clocks and f"bubble {s.bubble():.4f}" in case["text"]
    lines = got["picture"].splitlines()
    assert lines[0].startswith("clock  0") and lines[1].startswith("rank 0 F0")
    for r in range(s.pp):  # every microbatch's forward and backward appears once per stage of the rank
        cells = " ".join(line for line in lines if line.startswith(f"rank {r} "))  # over every band of clocks
        assert len(cells.split()) - cells.count("rank") * 2 == s.clocks
        assert sum(cells.count(f"F{i}") for i in range(s.microbatches)) == s.microbatches * s.virtual
        assert sum(cells.count(f"B{i}") for i in range(s.microbatches)) == s.microbatches * s.virtual


def test_transfers_match_the_compiled_collective_permutes(case):
    x, s = case["report"]["pipeline"]["transfers"], case["schedule"]
    permutes = [
        c
        for c in parse_collectives(case["step"].as_text())
        if c.kind == "collective-permute" and c.op_name.endswith("/ppermute")
    ]  # the pipeline's own
    assert x["compiled"]["bytes"] == sum(c.total_bytes for c in permutes) > 0
    assert x["compiled"]["count"] == sum(c.count for c in permutes)
    clocks = int(np.count_nonzero(s.kinds & FWD)) + int(np.count_nonzero(s.kinds & BWD))
    assert x["expected"]["count"] == clocks == x["compiled"]["count"]
    assert x["expected"]["bytes"] == x["compiled"]["bytes"] == clocks * x["per_device_bytes"]
    mb = (8 // s.microbatches) * 32 * 64 * 4  # one microbatch's stage input [B/M, T, d_model], float32
    assert x["microbatch_bytes"] == mb and mb % x["per_device_bytes"] == 0
    useful = x["useful_by_rank"]  # every stage but the last sends M activations, every stage but the first M cotangents
    assert (
        sum(u["activations"] for u in useful)
        == sum(u["cotangents"] for u in useful)
        == s.microbatches * (s.pp * s.virtual - 1)
    )
    pp_rows = [c for c in case["report"]["collectives"] if "pp" in c["axes"]]
    assert {c["role"] for c in pp_rows if c["kind"] == "collective-permute"} == {"stage transfer"}
    assert any(c["role"] == "sum over stages" for c in pp_rows)  # the replicated tables' gradients
    assert (s.virtual > 1) == (x["relayout_bytes"] > 0)  # interleaved: layers move to their virtual stages
    assert "stage transfer" in case["text"] and f"= {x['compiled']['bytes']:,} B per device" in case["text"]


def test_per_stage_memory(case):
    m, s = case["report"]["pipeline"]["memory"], case["schedule"]
    params = {p["path"]: p["bytes"] for p in case["report"]["parameters"]}
    layers = sum(b for p, b in params.items() if p.startswith("layers/"))
    assert m["state_layers"] == 3 * layers  # parameters and two Adam moments of this rank's layers only
    assert m["params+opt_state"] == m["state_layers"] + m["state_embedding+head"]  # compiled == layouts
    assert case["report"]["memory"]["params+opt_state"] == m["params+opt_state"]
    mb = m["microbatch_bytes"]
    assert m["stash_buffer"] == (s.act_slots + 1) * mb and max(m["stash_by_rank"]) == s.act_slots * mb
    if s.virtual == 1:  # stage 0 recomputes its input from the tokens: rank 0 stashes nothing
        assert m["stash_by_rank"][0] == 0
    assert m["temporaries"] > m["stash_buffer"] + m["cotangent_buffer"]
    if s.name == "gpipe":  # every microbatch's input waits for its backward
        assert m["stash_by_rank"][1:] == [s.microbatches * mb] * (s.pp - 1)
    if s.name == "1f1b":
        assert max(m["in_flight_by_rank"]) <= 2 * s.pp * mb
    psi = case["report"]["memory"]["n_params"]
    whole = sum(math.prod(p["shape"]) for p in case["report"]["parameters"])
    assert psi < whole  # Ψ is one stage's parameters
    assert "per stage, per device" in case["text"] and "activation stash by rank" in case["text"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--pp=3"], "--pp=3 does not divide the 8 devices"),
        (["--pp=2", "--microbatches=1"], "--microbatches=1 is fewer than the --pp=2"),
        (["--pp=2", "--virtual_stages=2"], "--virtual_stages=2 needs --pipeline_schedule=interleaved"),
        (["--pp=2", "--pipeline_schedule=zigzag"], "--pipeline_schedule=zigzag"),
        (["--pp=2", "--grad_accum=2"], "drop --grad_accum"),
        (["--pp=2", "--microbatches=3"], "does not split into --microbatches=3"),
        (
            ["--pp=4", "--mesh_dim=1,2,1,1", "--pipeline_schedule=interleaved", "--virtual_stages=2"],
            "do not split into --pp=4",
        ),
        (["--pp=2", "--zero_stage=1"], "--zero_stage=1 with --pp"),
    ],
)
def test_bad_pipeline_flags_are_one_line(capsys, flags, words):
    code = main(
        [
            "explain",
            "--model=test",
            "--model.n_layers=4",
            "--mesh_dim=1,2,2,1",
            "--batch_size=16",
            "--seq_len=32",
            *flags,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1, err


def test_the_command_line_exits_2_on_a_bad_pp():
    out = meshlm("explain", "--devices=8", "--model=test", "--pp=3")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--pp=3" in out.stderr, out.stderr


def test_collective_axes_from_every_spelling_of_the_groups():
    """Self-pairs first in a collective-permute, and mesh groups over an iota of device ids: the axes
    are those the devices of one group differ in."""
    import jax

    from meshlm.explain.analysis import collectives
    from meshlm.mesh import build_mesh, parse_mesh_dim
    from meshlm.models.placement import place
    from meshlm.models.presets import resolve_model

    placement = place(
        resolve_model("test", {"n_layers": "4"}), build_mesh(parse_mesh_dim("1,2,2,1", 8, pp=2), jax.devices())
    )
    hlo = """ENTRY %main (x: f32[4]) -> f32[4] {
  %cp = f32[4]{0} collective-permute(f32[4]{0} %x), channel_id=1, source_target_pairs={{0,0},{5,1},{1,5}}, metadata={op_name="jit(step)/reshape"}
  %ar = f32[4]{0} all-reduce(f32[4]{0} %x), channel_id=2, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add
}
"""
    rows = collectives(hlo, placement)
    assert [(r.kind, r.axes) for r in rows] == [("collective-permute", ("pp",)), ("all-reduce", ("fsdp", "tp"))]
