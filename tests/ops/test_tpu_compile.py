"""The whole train step compiled ahead of time for 4 TPU v5p chips (libtpu, no TPU needed) runs splash
attention: Pallas TPU calls in the program and no XLA conditional (the blockwise kernel's block
skipping) left, with per-device memory from the TPU compiler's own `memory_analysis()`.

Skips, saying why, without the `libtpu` package (`pip install -e .[tpu]`). The llama2-7b figure
(batch 4 x 4096, fsdp 4, remat full) is printed by running this file:

    python tests/ops/test_tpu_compile.py [--model=llama2-7b --batch=4 --seq=4096]
"""

import argparse
import os
import re
import sys
import time
from pathlib import Path

import pytest

# Several processes may hold libtpu at once here (it only compiles): skip its one-process lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
V5P_HBM = 95 * 2**30  # bytes of HBM per v5p chip
# Gemma 2's layer on the tiny shape: a local layer (window 128) then a global one, soft-capped scores and logits.
GEMMA2_LIKE = dict(
    n_layers=2, n_kv_heads=2, sliding_window=128, layer_pattern="LG", attn_logit_softcap=50.0, final_logit_softcap=30.0,
    attention_scale=0.1, post_norms=True, norm_offset=1.0, embed_scale=True, mlp_activation="gelu_tanh",
    tie_embeddings=True,
)  # fmt: skip


def compile_for_v5p(model: str, batch: int, seq: int, **overrides):
    """(compiled train step, its HLO text, seconds to compile) on v5p:2x2x1 with mesh 1,4,1,1."""
    from jax.experimental import topologies

    from meshlm.explain.verify import compile_placed
    from meshlm.mesh import parse_mesh_dim
    from meshlm.models.policy import RunPolicy
    from meshlm.models.presets import resolve_model
    from meshlm.plan.job import Job

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    cfg, policy = resolve_model(model, overrides), RunPolicy(dtype="bfloat16", remat="full")
    start = time.perf_counter()
    compiled, _ = compile_placed(Job(cfg, batch_size=batch, seq_len=seq, n_devices=4, policy=policy),
                                 parse_mesh_dim("1,4,1,1", 4), list(devices))  # fmt: skip
    return compiled, compiled.as_text(), time.perf_counter() - start


@pytest.mark.slow
def test_train_step_compiles_for_tpu_v5p_with_splash_attention():
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e .[tpu]): no TPU compile")
    compiled, hlo, _ = compile_for_v5p("tiny", batch=4, seq=512, n_layers=1, n_kv_heads=2)
    assert "tpu_custom_call" in hlo  # the Pallas kernels
    assert "conditional" not in hlo  # no blockwise kernel left
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    assert 0 < mem.temp_size_in_bytes and 0 < peak < V5P_HBM


def test_local_and_global_layers_compile_for_tpu_v5p_with_splash():
    """Both kinds of layer run splash (the local one with its window mask and the soft cap): one backward
    kernel each, no blockwise fallback (an XLA conditional) for either."""
    pytest.importorskip("libtpu", reason="libtpu is not installed (pip install -e .[tpu]): no TPU compile")
    compiled, hlo, _ = compile_for_v5p("tiny", batch=4, seq=512, **GEMMA2_LIKE)
    assert len(re.findall(r"%splash_mha_dkv\w*\.\d+ = ", hlo)) == 2
    assert "conditional" not in hlo
    assert 0 < compiled.memory_analysis().temp_size_in_bytes < V5P_HBM


def main() -> None:
    parser = argparse.ArgumentParser(description="compile the train step for 4 TPU v5p chips; print its memory")
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    compiled, hlo, seconds = compile_for_v5p(args.model, args.batch, args.seq)
    m = compiled.memory_analysis()
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    print(f"{args.model} batch {args.batch} x {args.seq}, mesh 1,4,1,1 on v5p:2x2x1, bf16, remat full, "
          f"compiled in {seconds:.0f} s")  # fmt: skip
    print(f"per device: arguments {gib(m.argument_size_in_bytes)}, temporaries {gib(m.temp_size_in_bytes)}, "
          f"peak {gib(peak)} of {gib(V5P_HBM)} HBM")  # fmt: skip
    print(f"Pallas TPU calls: {hlo.count('tpu_custom_call')}, XLA conditionals: {hlo.count('conditional')}")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
