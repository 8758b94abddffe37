"""Backend profiles: each backend's choices in one place, and the model, kernels and step asking it."""

import ast
from pathlib import Path

import pytest

import meshlm
from meshlm import backends, platform
from meshlm.backends import CPU, GPU, TPU, profile_for
from meshlm.ops import kernels

ROOT = Path(meshlm.__file__).parent


@pytest.mark.parametrize("name, profile", [("cpu", CPU), ("gpu", GPU), ("cuda", GPU), ("rocm", GPU), ("tpu", TPU)])
def test_profile_for_a_jax_platform_name(name, profile):
    assert profile_for(name) is profile


def test_each_backend_keeps_its_choices():
    assert (CPU.fused_attention, GPU.fused_attention, TPU.fused_attention) == ((), ("cudnn", "triton"), ("splash",))
    assert [p.unroll_layers for p in (CPU, GPU, TPU)] == [False, True, False]
    for flag in ("float32_weight_gradients", "fence_head_gradient", "one_reduction_grad_norm", "keeps_host_memory"):
        assert [getattr(p, flag) for p in (CPU, GPU, TPU)] == [True, False, False], flag
    assert {p.dense_attention_below for p in (CPU, GPU, TPU)} == {kernels.DENSE_BELOW} == {256}
    assert GPU.xla_flags() == platform.xla_flag_preset("gpu") and CPU.xla_flags() == {}


def test_auto_attention_follows_the_profile():
    call = kernels.Call(platform="cpu", q_len=255, kv_len=255, head_dim=64, dtype="bfloat16", packed=True, causal=True)
    assert kernels.choose("auto", call) == "dense"
    assert kernels.choose("auto", call._replace(q_len=256, kv_len=256)) == "blockwise"
    assert kernels.choose("auto", call._replace(platform="tpu")) == "splash"
    assert kernels.choose("auto", call._replace(platform="gpu", gpu_capability=9.0)) == "cudnn"


def test_only_the_cpu_keeps_a_scratch_block_for_remat_auto(monkeypatch):
    monkeypatch.setattr(platform, "keep_host_memory", lambda environ=None: True)
    assert CPU.kept_block_bytes() == platform.KEPT_BLOCK_BYTES
    assert GPU.kept_block_bytes() is None and TPU.kept_block_bytes() is None
    monkeypatch.setattr(platform, "keep_host_memory", lambda environ=None: False)
    assert CPU.kept_block_bytes() == 0


def _platform_comparisons(path: Path) -> list[str]:
    """`x.platform == "cpu"`, `active_platform() != "gpu"` and the like in a module's code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In)) for op in node.ops):
            text = ast.unparse(node)
            if "platform" in text and any(f"'{p}'" in text for p in ("cpu", "gpu", "tpu")):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {text}")
    return found


def test_the_model_and_the_step_ask_the_profile_not_the_platform():
    modules = [ROOT / "train" / "step.py", ROOT / "ops" / "linear.py"] + sorted((ROOT / "models").glob("*.py"))
    found = [hit for path in modules for hit in _platform_comparisons(path)]
    assert not found, "ask meshlm.backends' profile instead: " + "; ".join(found)
    assert backends.traced_profile() is CPU  # these tests run on CPU devices
