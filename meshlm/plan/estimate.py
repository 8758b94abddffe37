"""One mesh's predictions, with or without pipeline stages: the one place that chooses between the flat
estimators (`memory`, `comms`, `cost`) and the pipelined one (`pipeline`) by the mesh's pp.

    pie = memory_pie(job, shape, memory.compiler_for(hw.name))
    found = collectives(job, shape, hw.backend)
    ops = operators(job, shape, hw, found)
    time = step_time(job, shape, hw, ops, found, pie.params)
"""

from __future__ import annotations

from meshlm.mesh import MeshShape
from meshlm.plan import comms, cost, memory, pipeline
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job


def memory_pie(job: Job, shape: MeshShape, compiler: str = "cpu") -> memory.MemoryPie:
    """Bytes per device: parameters, gradients, optimizer state, activations, temporaries (these as
    `compiler` assigns them: `memory.compiler_for(hw.name)`; pipelines keep XLA:CPU's)."""
    return pipeline.estimate(job, shape) if shape.pp > 1 else memory.estimate(job, shape, compiler)


def collectives(job: Job, shape: MeshShape, backend: str = "cpu") -> list[comms.Collective]:
    """Every collective of one step, per device, as `backend`'s compiler emits them (`Hardware.backend`)."""
    return pipeline.collectives(job, shape) if shape.pp > 1 else comms.predict(job, shape, backend)


def operators(job: Job, shape: MeshShape, hw: Hardware, found: list[comms.Collective]) -> list[cost.Operator]:
    """The operator table, each operator rated against the hardware with its share of `found`."""
    table = pipeline.operator_table if shape.pp > 1 else cost.operator_table
    return table(job, shape, hw, found)


def step_time(
    job: Job, shape: MeshShape, hw: Hardware, ops: list[cost.Operator], found: list[comms.Collective], params_bytes: int
) -> cost.StepTime:
    """The predicted step: compute, HBM-bound work and the communication not hidden behind them."""
    elementwise = (
        pipeline.elementwise_bytes(job, shape) if shape.pp > 1 else cost.elementwise_bytes(job, shape, hw.backend)
    )
    return cost.step_time(job, shape, hw, ops, found, params_bytes, elementwise)
