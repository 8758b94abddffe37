"""The plan's layering: flat estimators know nothing of pipeline stages, plan never imports explain, and
`meshlm.plan.estimate` gives the flat figures for pp = 1 and the pipelined ones for pp > 1."""

import ast
from pathlib import Path

import pytest

from meshlm.mesh import parse_mesh_dim
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import resolve_model
from meshlm.plan import comms, cost, estimate, memory, pipeline
from meshlm.plan.hardware import CATALOG
from meshlm.plan.job import Job, PipelineFlags

PLAN = Path(__file__).resolve().parents[2] / "meshlm" / "plan"
FLAT = ("memory", "comms", "cost", "state_bytes")
ABOVE_FLAT = (
    "meshlm.plan.pipeline",
    "meshlm.plan.schedule",
    "meshlm.plan.estimate",
    "meshlm.plan.search",
    "meshlm.explain.verify",
    "meshlm.plan.report",
)


def imported(module: str) -> set[str]:
    """Every meshlm module (and `package.name`) a plan module imports, inside functions too."""
    out = set()
    for node in ast.walk(ast.parse((PLAN / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("meshlm")}


@pytest.mark.parametrize("module", FLAT)
def test_flat_estimators_do_not_import_the_pipeline(module):
    found = imported(module)
    assert not found & set(ABOVE_FLAT), found & set(ABOVE_FLAT)


def test_plan_never_imports_explain_nor_private_names():
    for path in PLAN.glob("*.py"):
        names = imported(path.stem)
        assert not any(m.startswith("meshlm.explain") or m.startswith("meshlm.cli") for m in names), (path.name, names)
        assert not any(m.rsplit(".", 1)[-1].startswith("_") and not m.endswith("__") for m in names), (path.name, names)


def test_estimate_picks_flat_or_pipelined_by_pp():
    cfg = resolve_model("test", {"n_layers": "4"})
    job = Job(cfg, 16, 32, 8, 1, PipelineFlags("gpipe", 4), RunPolicy(dtype="float32"))
    hw = CATALOG["h100"]
    flat, staged = parse_mesh_dim("1,2,2,2", 8), parse_mesh_dim("1,1,4,1", 8, pp=2)
    assert estimate.memory_pie(job, flat) == memory.estimate(job, flat)
    assert estimate.memory_pie(job, staged) == pipeline.estimate(job, staged)
    assert estimate.collectives(job, flat) == comms.predict(job, flat)
    assert estimate.collectives(job, staged) == pipeline.collectives(job, staged)
    names = [op.name for op in estimate.operators(job, staged, hw, estimate.collectives(job, staged))]
    assert names[-1] == "pipeline" and "pipeline" not in [op.name for op in cost.operator_table(job, flat, hw, [])]
    flat_ops = estimate.operators(job, flat, hw, comms.predict(job, flat))
    time = estimate.step_time(job, flat, hw, flat_ops, comms.predict(job, flat), memory.estimate(job, flat).params)
    assert time.memory_s * hw.hbm_bandwidth == pytest.approx(
        cost.elementwise_bytes(job, flat, hw.backend) + 7 * memory.estimate(job, flat).params
    )
