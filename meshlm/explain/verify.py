"""Check a plan against the compiler: compile the real train step with abstract inputs, nothing allocated.

`meshlm.train.step.make_train_step` is lowered with `abstract_state` and a batch of
ShapeDtypeStructs carrying their shardings, then compiled for the plan's mesh on simulated CPU
devices, or for a TPU target on that TPU topology through libtpu (`pip install -e '.[tpu]'`; without
it `--verify` says so). Collective bytes are compared with the prediction for the compiler that
compiled (`meshlm.plan.comms.predict`'s backend). The compiled program gives per-device memory
(`memory_analysis()`: argument + output - alias + temp bytes, the state, the batch and the peak of
everything else) and its collectives (`meshlm.hlo`).
"""

from __future__ import annotations

import time
from typing import Any

from meshlm import hlo
from meshlm.errors import UsageError
from meshlm.mesh import MeshShape
from meshlm.plan import comms
from meshlm.plan.hardware import backend_of
from meshlm.plan.job import Job
from meshlm.plan.schedule import schedule_of
from meshlm.plan.search import Plan

# TPU topology names `jax.experimental.topologies.get_topology_desc` understands, per catalog entry.
_TPU_TOPOLOGY = {"tpu-v4": ("v4", 3), "tpu-v5e": ("v5e", 2), "tpu-v5p": ("v5p", 3), "tpu-v6e": ("v6e", 2)}


def _topology_name(version: str, dims: int, n: int) -> str | None:
    """'v6e:4x4' style name for n chips, as square as possible, largest side first ('v5p:2x2x1': libtpu
    refuses '1x2x2')."""
    sides = [1] * dims
    remaining = n
    while remaining > 1:
        i = sides.index(min(sides))
        if remaining % 2:
            return None
        sides[i] *= 2
        remaining //= 2
    return f"{version}:{'x'.join(str(s) for s in sorted(sides, reverse=True))}"


def target_devices(n: int, hardware: str = "cpu") -> tuple[list[Any], str]:
    """n devices to compile for, and what they are: a TPU topology when possible, else simulated CPUs."""
    import jax

    if hardware in _TPU_TOPOLOGY:
        import importlib.util
        import os

        if importlib.util.find_spec("libtpu") is None:
            raise UsageError(
                f"--verify with --hardware={hardware} compiles for the TPU topology through libtpu, "
                f"which is not installed: pip install -e '.[tpu]' in meshlm's folder (or verify with --hardware=cpu)"
            )
        try:
            from jax.experimental import topologies

            os.environ.setdefault(
                "ALLOW_MULTIPLE_LIBTPU_LOAD", "1"
            )  # compiling only: share libtpu with other processes

            name = _topology_name(*_TPU_TOPOLOGY[hardware], n)
            if name:
                devices = topologies.get_topology_desc(topology_name=name, platform="tpu").devices
                if len(devices) == n:
                    return list(devices), f"TPU topology {name}"
        except Exception:  # noqa: BLE001 - a device count libtpu has no topology for: simulated CPUs
            pass
    cpus = jax.devices("cpu")  # with several processes: all of theirs
    if len(cpus) < n:
        raise UsageError(
            f"--verify needs {n} simulated CPU devices but this process has {len(cpus)}; run `meshlm plan` in a "
            f"fresh process (it sets up --devices={n} itself) or plan for at most {len(cpus)} devices"
        )
    processes = f" ({jax.process_count()} processes)" if jax.process_count() > 1 else ""
    return cpus[:n], f"{n} simulated CPU devices{processes}"


def compile_step(job: Job, shape: MeshShape, devices: list[Any]):
    """The compiled train step of this job on this mesh; nothing is allocated."""
    return compile_placed(job, shape, devices)[0]


def compile_placed(job: Job, shape: MeshShape, devices: list[Any]):
    """(compiled train step, its placement); with pp > 1 the pipelined step `meshlm train --pp` runs."""
    import jax
    import jax.numpy as jnp

    from meshlm import sharding
    from meshlm.mesh import build_mesh
    from meshlm.models.placement import place
    from meshlm.optimizer import OptimizerConfig, lr_schedule, make_optimizer
    from meshlm.train.state import abstract_state
    from meshlm.train.step import BATCH_KEYS, make_train_step

    mesh = build_mesh(shape, devices)
    placement = place(job.cfg, mesh, policy=job.policy)
    opt_cfg = OptimizerConfig()
    optimizer = make_optimizer(opt_cfg)
    rows = sharding.batch_sharding(mesh, placement.strategy)
    batch = {
        k: jax.ShapeDtypeStruct(
            (job.batch_size, job.seq_len), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=rows
        )
        for k in BATCH_KEYS
    }
    pipeline = schedule_of(job.pipeline, shape.pp) if shape.pp > 1 else None
    step: Any = make_train_step(placement, optimizer, lr_schedule(opt_cfg), job.grad_accum, pipeline)
    return step.lower(abstract_state(placement, optimizer), batch).compile(), placement


def stage_transfer_bytes(compiled, placement) -> int:
    """Bytes per device per step of the compiled step's stage transfers: the pipeline's ppermutes, which
    XLA compiles to collective-permutes between pp ranks (the ring attention's run over sp inside a
    stage, and the relayout of the layers onto virtual stages is no ppermute: both are left out)."""
    return sum(
        c.total_bytes
        for c in hlo.on_mesh(compiled.as_text(), placement.mesh)
        if c.kind == "collective-permute" and "pp" in c.axes and c.op_name.endswith("ppermute")
    )


def measure(compiled) -> dict:
    """Per-device figures of a compiled step: peak memory and collective payload bytes by kind."""
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {
        "peak_memory_bytes": int(peak),
        "argument_bytes": int(m.argument_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "collective_bytes": hlo.summarize(hlo.parse_collectives(compiled.as_text())),
    }


def error_percent(predicted: float, compiled: float) -> float | None:
    """(predicted - compiled) / compiled in percent; None when the compiled figure is 0."""
    return None if not compiled else 100.0 * (predicted - compiled) / compiled


def verify(job: Job, plans: list[Plan], k: int, hardware: str = "cpu") -> str:
    """Compile the first k plans; attach `plan.compiled` (figures and errors). Returns what was compiled for."""
    devices, where = target_devices(job.n_devices, hardware)
    for plan in plans[:k]:
        t0 = time.perf_counter()
        compiled, placement = compile_placed(plan.job, plan.shape, devices)
        got = measure(compiled)
        got["compile_seconds"] = round(time.perf_counter() - t0, 2)
        predicted_coll = plan.collective_bytes["total"]
        backend = devices[0].platform  # the compiler that compiled: "tpu" on a topology, else "cpu"
        if plan.shape.pp == 1 and backend != backend_of(hardware):  # compiled elsewhere than planned
            predicted_coll = comms.total_bytes(comms.predict(plan.job, plan.shape, backend))["total"]
        got["error_percent"] = {
            "peak_memory": error_percent(plan.memory.total, got["peak_memory_bytes"]),
            "collective_bytes": error_percent(predicted_coll, got["collective_bytes"]["total"]),
        }
        if plan.pipeline is not None:
            got["stage_transfer_bytes"] = stage_transfer_bytes(compiled, placement)
            got["error_percent"]["stage_transfers"] = error_percent(
                plan.pipeline.transfer_bytes, got["stage_transfer_bytes"]
            )
        got["compiled_for"] = where
        plan.compiled = got
    return where
