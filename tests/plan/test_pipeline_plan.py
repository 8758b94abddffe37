"""`meshlm plan` with pipeline stages: per-stage memory and stage transfers against the compiled
pipelined step, the bubble from the schedule, GPipe's stash against 1F1B's, and the pp flags.

One compile per grid case (abstract inputs, 8 simulated CPU devices), shared by the memory and the
transfer assertions. `python tests/plan/test_pipeline_plan.py` prints the grid's figures; with `--fit-set`, those of the
56 cases the memory coefficients were fitted to.
"""

import dataclasses
import json
import os
import sys

if __name__ == "__main__":  # the figures for docs/plan.md, outside pytest
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import pytest

from meshlm.cli import main
from meshlm.errors import UsageError
from meshlm.mesh import parse_mesh_dim
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.ops.pipeline import build_schedule
from meshlm.plan import estimate, pipeline, search
from meshlm.plan.hardware import CATALOG
from meshlm.plan.job import Job, PipelineFlags

# (mesh_dim, pp, schedule, microbatches, virtual stages, batch, remat, layers): pp 2 and 4, every
# schedule, every mesh axis inside the stages; the `test` model (d_model 64, 8 heads, vocab 512).
GRID = [
    ("1,1,4,1", 2, "gpipe", 4, 1, 8, "none", 4),
    ("1,2,2,1", 2, "1f1b", 8, 1, 16, "none", 4),
    ("1,1,2,2", 2, "interleaved", 4, 2, 8, "none", 4),
    ("1,1,2,1", 4, "gpipe", 8, 1, 16, "save_dots", 4),
    ("2,1,1,1", 4, "1f1b", 4, 1, 8, "none", 4),
    ("1,2,1,1", 4, "interleaved", 4, 2, 8, "full", 8),
]
IDS = [f"pp{pp}-{s}-M{m}-{mesh}-{remat}" for mesh, pp, s, m, v, b, remat, _ in GRID]


def job_for(mesh_dim, pp, schedule, microbatches, virtual, batch, remat, layers=8, seq=32):
    cfg = resolve_model("test", {"n_layers": str(layers)})
    job = Job(
        cfg, batch, seq, 8, 1, PipelineFlags(schedule, microbatches, virtual), RunPolicy(dtype="float32", remat=remat)
    )
    return job, parse_mesh_dim(mesh_dim, 8, pp=pp)


def compile_grid():
    """{case id: (job, shape, compiled figures)}: one compile per case."""
    import jax

    from meshlm.explain.verify import compile_placed, measure, stage_transfer_bytes

    out = {}
    for case, name in zip(GRID, IDS):
        job, shape = job_for(*case)
        compiled, placement = compile_placed(job, shape, jax.devices()[:8])
        got = measure(compiled)
        got["stage_transfer_bytes"] = stage_transfer_bytes(compiled, placement)
        out[name] = (job, shape, got)
    return out


@pytest.fixture(scope="module")
def compiled():
    return compile_grid()


def errors(job, shape, got) -> tuple[float, float]:
    """(memory, stage transfers) prediction errors in percent of the compiled figures."""
    from meshlm.explain.verify import error_percent

    plan = search.evaluate(job, shape, CATALOG["h100"])
    return (
        error_percent(plan.memory.total, got["peak_memory_bytes"]),
        error_percent(plan.pipeline.transfer_bytes, got["stage_transfer_bytes"]),
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", IDS)
def test_per_stage_memory_within_10_percent_of_the_compiled_step(compiled, name):
    mem, _ = errors(*compiled[name])
    assert abs(mem) <= 10.0, f"{name}: predicted per-device memory {mem:+.1f}% off the compiled peak"


@pytest.mark.slow
@pytest.mark.parametrize("name", IDS)
def test_stage_transfers_within_5_percent_of_the_compiled_permutes(compiled, name):
    _, xfer = errors(*compiled[name])
    assert abs(xfer) <= 5.0, f"{name}: predicted stage transfers {xfer:+.1f}% off the compiled collective-permutes"


@pytest.mark.parametrize("case", GRID, ids=IDS)
def test_bubble_and_clocks_are_the_schedules(case):
    job, shape = job_for(*case)
    plan = search.evaluate(job, shape, CATALOG["h100"])
    mesh, pp, name, M, V, batch, remat, layers = case
    s = build_schedule(name, pp, M, V)
    got = plan.pipeline
    assert got.schedule.clocks == s.clocks and got.schedule.act_slots == s.act_slots
    assert got.forward_clocks + got.backward_clocks == sum(1 for k in s.kinds if k & 1) + sum(
        1 for k in s.kinds if k & 2
    )
    assert got.bubble == pytest.approx(s.bubble(V * got.forward_clock_s, V * got.backward_clock_s))
    doc = got.as_dict()
    assert doc["bubble_schedule"] == pytest.approx(s.bubble())
    assert doc["bubble_theoretical"] == pytest.approx(s.theoretical_bubble())
    if name != "interleaved":
        assert s.bubble() == pytest.approx((pp - 1) / (M + pp - 1))
    # transfers: one stage input per forward clock and one cotangent per backward clock, per device
    rows = job.batch_size // M
    assert got.transfer_bytes == (got.forward_clocks + got.backward_clocks) * rows * 32 * 64 * 4 // (
        shape.data * shape.sp
    )
    # every rank holds its L/pp layers; the busiest rank's stash is what every rank allocates
    assert [sum(b - a + 1 for a, b in st.layers) for st in got.stages] == [layers // pp] * pp
    assert max(st.in_flight for st in got.stages) == s.act_slots
    assert got.worst.in_flight == s.act_slots


def test_gpipe_memory_grows_with_microbatches_and_1f1b_stays_flat():
    """pp = 4, 2 rows per microbatch: GPipe stashes all M microbatch inputs, 1F1B at most 2·pp."""
    cfg = resolve_model(
        "test", {"n_layers": "4", "d_model": "256", "n_heads": "4", "n_kv_heads": "4", "mlp_dim": "256"}
    )
    shape = parse_mesh_dim("1,1,2,1", 8, pp=4)

    def total(name, M):
        job = Job(cfg, 2 * M, 64, 8, 1, PipelineFlags(name, M), RunPolicy(dtype="float32"))
        return estimate.memory_pie(job, shape).total

    f = [total("1f1b", M) for M in (8, 16, 32)]
    g = [total("gpipe", M) for M in (8, 16, 32)]
    assert f[2] <= 1.02 * f[0], f
    assert g[0] < g[1] < g[2] and g[2] - g[0] > 20 * (f[2] - f[0]), (g, f)
    slot = 2 * 64 * 256 * 4
    assert g[2] - g[1] >= 16 * slot  # each more microbatch in flight is one more stage input stashed


def plan_json(capsys, *flags):
    rc = main(
        [
            "plan",
            "--model=test",
            "--model.n_layers=4",
            "--devices=8",
            "--batch_size=16",
            "--seq_len=32",
            "--hardware=h100",
            "--json",
            *flags,
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_pp_plans_in_the_json_and_the_train_command(capsys):
    doc = plan_json(capsys, "--pp=2", "--pipeline_schedule=gpipe", "--microbatches=4")
    assert doc["plans"] and all(p["pp"] == 2 for p in doc["plans"])
    first = doc["plans"][0]
    pl = first["pipeline"]
    assert (pl["schedule"], pl["microbatches"], pl["pp"]) == ("gpipe", 4, 2)
    assert [s["layers"] for s in pl["stages"]] == [[[0, 1]], [[2, 3]]]
    assert (
        pl["transfer_bytes_per_device_per_step"]
        == (pl["forward_clocks"] + pl["backward_clocks"]) * pl["transfer_bytes_per_message"]
    )
    assert first["mesh"]["pp"] == 2
    assert "--pp=2 --pipeline_schedule=gpipe --microbatches=4" in first["command"]
    kinds = {op["name"] for op in first["operators"]}
    assert "pipeline" in kinds


def test_pp_auto_ranks_meshes_with_and_without_stages(capsys):
    doc = plan_json(capsys, "--pp=auto")
    pps = {p.get("pp", 1) for p in doc["plans"]}
    assert {1, 2, 4} <= pps
    assert all(("--pp=" in p["command"]) == (p.get("pp", 1) > 1) for p in doc["plans"])


def test_named_mesh_dim_takes_pp_and_the_table_shows_the_stages(capsys):
    rc = main(
        [
            "plan",
            "--model=test",
            "--model.n_layers=4",
            "--devices=8",
            "--batch_size=16",
            "--seq_len=32",
            "--hardware=h100",
            "--mesh_dim=pp:2,tp:4",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for words in ("bubble", "xfer GB", "stage transfers", "in flight", "(limits)", "replicated on every stage"):
        assert words in out
    assert "recommended: meshlm train --model=test --model.n_layers=4 --mesh_dim=1,1,4,1 --pp=2" in out


def test_png_with_pipeline_plans(capsys, tmp_path):
    path = tmp_path / "plan.png"
    plan_json(capsys, "--pp=auto", f"--png={path}")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD = [
    (["--pp=0"], "--pp=0 must be a positive integer"),
    (["--pp=two"], "--pp=two: give a number of pipeline stages or auto"),
    (["--pp=3"], "--pp=3 does not divide the 8 devices"),
    (["--pp=2", "--pipeline_schedule=zigzag"], "--pipeline_schedule=zigzag: choose one of gpipe, 1f1b, interleaved"),
    (["--pp=2", "--microbatches=1"], "--microbatches=1 is fewer than the --pp=2 stages"),
    (["--pp=2", "--virtual_stages=2"], "--virtual_stages=2 needs --pipeline_schedule=interleaved"),
    (
        ["--pp=4", "--pipeline_schedule=interleaved", "--virtual_stages=2"],
        "do not split into --pp=4 × --virtual_stages=2",
    ),
    (["--pp=2", "--grad_accum=2"], "--grad_accum with --pp"),
    (["--pp=auto", "--mesh_dim=1,1,4,1"], "--pp=auto searches the meshes"),
    (["--mesh_dim=pp:2,tp:4", "--pp=4"], "give pp a size, once"),
    (["--pp=2", "--mesh_dim=1,8,1,1"], "make the product 4"),
    (
        ["--pp=2", "--batch_size=4", "--microbatches=4", "--mesh_dim=1,4,1,1"],
        "--batch_size=4 does not split into --microbatches=4",
    ),
]


@pytest.mark.parametrize("flags,words", BAD, ids=[f[0][0] + str(i) for i, f in enumerate(BAD)])
def test_bad_pipeline_flags_are_one_line_exit_2(capsys, flags, words):
    rc = main(["plan", "--model=test", "--model.n_layers=4", "--devices=8", "--batch_size=16", "--seq_len=32", *flags])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and out.out == "" and len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert words in lines[0], lines[0]


def test_nothing_fits_names_pipeline_stages_when_they_would(monkeypatch):
    """When no mesh fits and stages would (here: the stage memory is made small), the one line says --pp."""
    cfg = resolve_model("test", {"n_layers": "4"})
    job = Job(cfg, 8, 32, 8, policy=RunPolicy(dtype="float32", remat="full"))
    real = estimate.memory_pie

    def squeezed(job, shape, compiler="cpu"):
        pie = real(job, shape, compiler)
        return pie if shape.pp == 1 else type(pie)(1, 0, 0, 0, 0)

    monkeypatch.setattr(estimate, "memory_pie", squeezed)
    hw = dataclasses.replace(CATALOG["h100"], hbm_bytes=1e5)
    with pytest.raises(UsageError, match=r"nearest change that fits: --pp=2 \(e.g. --mesh_dim=\d,\d,\d,\d --pp=2\)"):
        search.search(job, hw)


def test_stages_hold_their_layers_and_the_tables():
    """State per device: L/pp layers (exact, the layers axis maps to pp) and the whole tables on every rank."""
    from meshlm.plan.state_bytes import state_bytes

    cfg = resolve_model("test", {"n_layers": "8"})
    sb = state_bytes(cfg)
    one, four = parse_mesh_dim("1,1,1,1", 1), parse_mesh_dim("1,1,1,1", 4, pp=4)
    tables = 2 * cfg.vocab_size * cfg.d_model * 4 + cfg.d_model * 4
    assert sb.params_bytes(four) - tables == pytest.approx((sb.params_bytes(one) - tables) / 4)
    job = Job(cfg, 8, 32, 4, 1, PipelineFlags("1f1b", 4), RunPolicy(dtype="float32"))
    terms = pipeline.memory_terms(job, four)
    assert terms["acc_tables"] == tables and terms["acc_layers"] == sb.params_bytes(four) - tables


# The 56 cases the memory coefficients were fitted to (meshlm.plan.pipeline.COEFFS): the `test` model
# with these overrides; (model, mesh_dim, pp, schedule, microbatches, virtual stages, batch, seq_len,
# remat), each on pp × dp × fsdp × tp × sp simulated devices, float32.
FIT_MODELS = {
    "D": {"n_layers": "4", "d_model": "256", "n_heads": "4", "n_kv_heads": "4", "mlp_dim": "512", "vocab_size": "256"},
    "D8": {"n_layers": "8", "d_model": "256", "n_heads": "4", "n_kv_heads": "4", "mlp_dim": "512", "vocab_size": "256"},
    "DV": {
        "n_layers": "8",
        "d_model": "128",
        "n_heads": "4",
        "n_kv_heads": "2",
        "mlp_dim": "384",
        "vocab_size": "2048",
    },
    "F": {"n_layers": "4", "d_model": "256", "n_heads": "4", "n_kv_heads": "4", "mlp_dim": "256"},
    "G": {"n_layers": "8", "n_kv_heads": "4"},
    "M8": {"n_layers": "8", "d_model": "128", "n_heads": "8", "n_kv_heads": "8", "mlp_dim": "512", "vocab_size": "512"},
    "T": {"n_layers": "4"},
    "T8": {"n_layers": "8"},
    "V": {"n_layers": "4", "vocab_size": "2048"},
    "W": {"n_layers": "4", "d_model": "128", "n_heads": "4", "n_kv_heads": "4", "mlp_dim": "256", "vocab_size": "1024"},
}
FIT_CASES = [
    ("G", "1,1,1,2", 4, "1f1b", 16, 1, 32, 32, "none"),
    ("M8", "1,2,1,2", 2, "1f1b", 8, 1, 16, 64, "full"),
    ("T", "1,4,1,1", 2, "interleaved", 4, 2, 16, 64, "none"),
    ("V", "1,1,1,4", 2, "1f1b", 2, 1, 4, 32, "none"),
    ("D", "1,1,2,2", 2, "interleaved", 4, 1, 4, 64, "full"),
    ("M8", "1,1,1,1", 8, "interleaved", 16, 1, 16, 64, "save_dots"),
    ("W", "2,1,1,1", 4, "gpipe", 8, 1, 16, 32, "save_qkv_attn"),
    ("DV", "1,1,1,2", 4, "interleaved", 4, 2, 8, 64, "none"),
    ("D8", "1,1,1,1", 8, "1f1b", 16, 1, 16, 64, "save_qkv_attn"),
    ("DV", "2,1,1,1", 4, "1f1b", 8, 1, 16, 64, "save_dots"),
    ("T", "1,1,4,1", 2, "interleaved", 2, 2, 4, 32, "none"),
    ("G", "1,1,1,4", 2, "gpipe", 4, 1, 4, 64, "none"),
    ("W", "2,1,1,1", 4, "gpipe", 4, 1, 8, 64, "save_qkv_attn"),
    ("W", "2,1,1,1", 4, "1f1b", 16, 1, 32, 64, "save_dots"),
    ("G", "2,1,2,1", 2, "1f1b", 4, 1, 8, 32, "full"),
    ("G", "1,1,2,1", 4, "interleaved", 4, 2, 4, 32, "save_dots"),
    ("W", "1,1,4,1", 2, "1f1b", 8, 1, 16, 32, "save_qkv_attn"),
    ("M8", "4,1,1,1", 2, "interleaved", 4, 2, 16, 32, "full"),
    ("W", "1,4,1,1", 2, "1f1b", 2, 1, 8, 64, "full"),
    ("W", "2,1,1,1", 4, "gpipe", 4, 1, 8, 32, "save_qkv_attn"),
    ("M8", "4,1,1,1", 2, "gpipe", 4, 1, 16, 64, "none"),
    ("G", "2,1,1,1", 4, "interleaved", 8, 2, 16, 64, "none"),
    ("W", "1,1,2,2", 2, "interleaved", 4, 1, 8, 32, "full"),
    ("G", "2,1,1,1", 4, "interleaved", 4, 2, 8, 32, "none"),
    ("W", "1,1,4,1", 2, "interleaved", 4, 2, 8, 64, "full"),
    ("D8", "2,1,2,1", 2, "gpipe", 8, 1, 16, 32, "save_qkv_attn"),
    ("G", "1,2,1,1", 4, "1f1b", 4, 1, 8, 32, "none"),
    ("D8", "1,2,1,2", 2, "gpipe", 8, 1, 16, 32, "full"),
    ("D8", "1,2,1,1", 4, "1f1b", 8, 1, 16, 32, "full"),
    ("DV", "1,4,1,1", 2, "gpipe", 2, 1, 8, 32, "none"),
    ("M8", "2,2,1,1", 2, "gpipe", 8, 1, 32, 64, "save_dots"),
    ("G", "1,1,2,2", 2, "gpipe", 2, 1, 2, 64, "save_qkv_attn"),
    ("D8", "1,1,1,2", 4, "1f1b", 8, 1, 8, 32, "full"),
    ("M8", "2,1,2,1", 2, "gpipe", 8, 1, 16, 64, "full"),
    ("V", "1,1,2,2", 2, "gpipe", 4, 1, 4, 64, "none"),
    ("D8", "1,2,1,2", 2, "1f1b", 2, 1, 4, 32, "full"),
    ("D", "1,1,2,2", 2, "gpipe", 8, 1, 8, 32, "none"),
    ("T", "1,2,1,2", 2, "gpipe", 4, 1, 8, 32, "none"),
    ("T", "2,1,1,1", 4, "1f1b", 8, 1, 16, 32, "save_qkv_attn"),
    ("D8", "4,1,1,1", 2, "interleaved", 2, 2, 8, 64, "full"),
    ("G", "1,1,1,1", 8, "gpipe", 8, 1, 8, 32, "full"),
    ("V", "2,1,2,1", 2, "1f1b", 8, 1, 16, 32, "none"),
    ("D", "1,1,1,4", 2, "1f1b", 8, 1, 16, 64, "save_qkv_attn"),
    ("M8", "1,2,1,2", 2, "1f1b", 2, 1, 4, 64, "none"),
    ("T", "1,1,4,1", 2, "gpipe", 4, 1, 8, 32, "none"),
    ("T", "1,2,2,1", 2, "1f1b", 8, 1, 16, 32, "none"),
    ("T", "1,1,2,2", 2, "interleaved", 4, 2, 8, 32, "none"),
    ("T", "1,1,2,1", 4, "gpipe", 8, 1, 16, 32, "save_dots"),
    ("T", "2,1,1,1", 4, "1f1b", 4, 1, 8, 32, "none"),
    ("T8", "1,2,1,1", 4, "interleaved", 4, 2, 8, 32, "full"),
    ("F", "1,1,1,1", 4, "1f1b", 8, 1, 16, 64, "none"),
    ("F", "1,1,1,1", 4, "1f1b", 16, 1, 32, 64, "none"),
    ("F", "1,1,1,1", 4, "1f1b", 32, 1, 64, 64, "none"),
    ("F", "1,1,1,1", 4, "gpipe", 8, 1, 16, 64, "none"),
    ("F", "1,1,1,1", 4, "gpipe", 16, 1, 32, 64, "none"),
    ("F", "1,1,1,1", 4, "gpipe", 32, 1, 64, 64, "none"),
]


def fit_set() -> None:
    """Compile the 56 cases (a few minutes) and print the predicted memory and collectives' errors."""
    import math
    import statistics

    import jax

    from meshlm.explain.verify import compile_placed, error_percent, measure, stage_transfer_bytes
    from meshlm.plan import comms

    mem, coll, xfer = [], [], []
    for model, mesh_dim, pp, schedule, M, V, batch, seq, remat in FIT_CASES:
        n = pp * math.prod(int(x) for x in mesh_dim.split(","))
        cfg, policy = resolve_model("test", FIT_MODELS[model]), RunPolicy(dtype="float32", remat=remat)
        job = Job(cfg, batch, seq, n, 1, PipelineFlags(schedule, M, V), policy)
        shape = parse_mesh_dim(mesh_dim, n, pp=pp)
        compiled, placement = compile_placed(job, shape, jax.devices()[:n])
        got = measure(compiled)
        plan = search.evaluate(job, shape, CATALOG["h100"])
        mem.append(error_percent(plan.memory.total, got["peak_memory_bytes"]))
        coll.append(error_percent(comms.total_bytes(plan.collectives)["total"], got["collective_bytes"]["total"]))
        xfer.append(error_percent(plan.pipeline.transfer_bytes, stage_transfer_bytes(compiled, placement)))
        print(
            f"   {model:3s} {mesh_dim} pp={pp} {schedule:11s} M={M:<2d} V={V} b{batch:<2d} t{seq} {remat:13s} "
            f"memory {mem[-1]:+6.1f}%  transfers {xfer[-1]:+5.1f}%  all collectives {coll[-1]:+6.1f}%",
            flush=True,
        )
    for what, errs in (("per-device memory", mem), ("stage transfers", xfer), ("all collectives", coll)):
        print(
            f"   {what:18s}: median |error| {statistics.median(abs(e) for e in errs):.1f}%, "
            f"range {min(errs):+.1f}% .. {max(errs):+.1f}%"
        )


if __name__ == "__main__" and "--fit-set" in sys.argv:
    print(f"fit set: {len(FIT_CASES)} cases on simulated CPU devices (float32)")
    fit_set()
elif __name__ == "__main__":
    import statistics

    print(f"pipeline grid: {len(GRID)} cases on 8 simulated CPU devices (test model, seq 32, float32)")
    print(
        f"   {'case':40s} {'peak MB':>8s} {'compiled':>9s} {'error':>7s}   {'xfer MB':>8s} {'compiled':>9s} {'error':>7s}"
    )
    mem_err, xfer_err = [], []
    for name, (job, shape, got) in compile_grid().items():
        plan = search.evaluate(job, shape, CATALOG["h100"])
        mem, xfer = errors(job, shape, got)
        mem_err.append(mem)
        xfer_err.append(xfer)
        print(
            f"   {name:40s} {plan.memory.total / 1e6:8.2f} {got['peak_memory_bytes'] / 1e6:9.2f} {mem:+6.1f}%   "
            f"{plan.pipeline.transfer_bytes / 1e6:8.3f} {got['stage_transfer_bytes'] / 1e6:9.3f} {xfer:+6.1f}%"
        )
    for what, errs in (("per-device memory", mem_err), ("stage transfers", xfer_err)):
        worst = max(errs, key=abs)
        print(
            f"   {what:18s}: median |error| {statistics.median(abs(e) for e in errs):.1f}%, worst {worst:+.1f}% "
            f"(range {min(errs):+.1f}% .. {max(errs):+.1f}%)"
        )
