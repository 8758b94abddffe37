"""The planner on the open families: local layers' attention counted over their window only, and
`meshlm plan` on gemma-2-9b and qwen3-8b presets printing plausible figures (no compiles)."""

import json

import pytest

from meshlm.cli import main
from meshlm.mesh import parse_mesh_dim
from meshlm.models.policy import RunPolicy
from meshlm.models.presets import PRESETS, resolve_model
from meshlm.plan import cost
from meshlm.plan.job import Job

SHAPE = parse_mesh_dim("1,2,2,2", 8)


def attention_flops(overrides, seq_len=512):
    cfg = resolve_model("test", {"n_layers": "4", **overrides})
    job = Job(cfg, 8, seq_len, 8, policy=RunPolicy(dtype="float32"))
    return cost.matmul_flops(job.local(SHAPE))["attention"]


def test_local_layers_count_their_window_in_the_operator_table():
    every_global = attention_flops({})
    assert attention_flops({"sliding_window": "512"}) == every_global  # a window of the whole row
    every_local = attention_flops({"sliding_window": "32"})
    alternating = attention_flops({"sliding_window": "32", "layer_pattern": "LG"})
    assert every_local < every_global / 7
    assert alternating == pytest.approx((every_local + every_global) / 2)


def plan_json(capsys, *flags):
    assert main(["plan", *flags, "--top=1", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "model, hardware, devices, global_twin",
    [
        ("gemma-2-9b", "tpu-v5p", 64, {"model.sliding_window": "0", "model.layer_pattern": ""}),
        ("qwen3-8b", "h100", 8, None),
    ],
)
def test_plan_of_a_family_preset_is_plausible(capsys, model, hardware, devices, global_twin):
    job = [f"--model={model}", f"--hardware={hardware}", f"--devices={devices}", f"--batch_size={devices}"]
    job += ["--seq_len=8192"]
    doc = plan_json(capsys, *job)
    assert doc["job"]["parameters"] == PRESETS[model].num_params()
    best = doc["plans"][0]
    predicted = best["predicted"]
    assert best["fits"] and 0.3 < predicted["mfu"] < 0.95
    assert 1e9 < predicted["memory_bytes_per_device"]["total"] < 140e9
    if global_twin:  # the same model without local layers spends more on attention
        flags = [f"--{k}={v}" for k, v in global_twin.items()]
        twin = plan_json(capsys, *job, *flags)["plans"][0]
        ops = {op["name"]: op["flops_per_device"] for op in best["operators"]}
        twin_ops = {op["name"]: op["flops_per_device"] for op in twin["operators"]}
        assert ops["attention"] < 0.9 * twin_ops["attention"]
        assert ops["mlp.in"] == twin_ops["mlp.in"]
