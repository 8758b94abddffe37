"""`meshlm plan`: choose --mesh_dim from memory and arithmetic intensity, and check it by compiling.

    meshlm plan --model=llama3-70b --devices=256 --hardware=h100 --batch_size=256 --seq_len=8192 --remat=full
    meshlm plan --model=tiny --devices=8 --hardware=cpu --verify=3 --png=outputs/plan.png
    meshlm plan --model=llama3-8b --devices=64 --hardware=tpu-v5p --json > plan.json

The job's flags are `meshlm train`'s (the same sections of meshlm.config, checked by meshlm.job);
the search, the cost model and the compile check live in meshlm.plan.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshlm import config
from meshlm.cli.flags import Parser, add_cluster_flags, add_dataclass_flags, split_model_overrides, train_config
from meshlm.errors import UsageError
from meshlm.mesh import MeshShape

# Flags of plan's own (--pp and --devices mean more here than in train); every other flag is a TrainConfig field.
PLAN_FLAGS = ("pp", "optimizer", "hardware", "devices", "hosts", "devices_per_host", "top", "verify", "json", "png")
MEANING = {
    "mesh_dim": "evaluate only this mesh (dp,fsdp,tp,sp; one entry may be -1; pp:N in the named form)",
    "devices": "device count [default: 8, or hosts × devices_per_host]",
}


def parser() -> argparse.ArgumentParser:
    from meshlm.plan.hardware import NAMES

    p = Parser(prog="meshlm plan", description="Rank every dp,fsdp,tp,sp mesh of the devices for one training job.")
    job = p.add_argument_group("the job (as in meshlm train)")
    add_dataclass_flags(job, config.ModelSection, only=("model", "init_from"))
    add_dataclass_flags(job, config.BatchConfig)
    add_dataclass_flags(job, config.PrecisionConfig)
    add_dataclass_flags(job, config.LoggingConfig, only=("peak_tflops",))
    job.add_argument("--optimizer", default="adamw", help="adamw (meshlm train's optimizer) [default: adamw]")
    add_dataclass_flags(job, config.MeshConfig, only=("mesh_dim",), meaning=MEANING)
    pipe = p.add_argument_group("pipeline stages (as in meshlm train)")
    pipe.add_argument(
        "--pp",
        default="1",
        help="pipeline stages, or auto: also plan every pp that divides the devices and the layers [default: 1]",
    )
    add_dataclass_flags(pipe, config.PipelineConfig, only=("pipeline_schedule", "microbatches", "virtual_stages"))
    add_cluster_flags(p, "for --verify, as in meshlm train")
    hw = p.add_argument_group("the devices")
    hw.add_argument("--hardware", default="h100", help=f"one of {', '.join(NAMES)} [default: h100]")
    add_dataclass_flags(hw, config.MeshConfig, only=("devices",), meaning=MEANING)
    hw.add_argument("--hosts", type=int, help="servers (GPU) or TPU hosts; with --devices_per_host gives --devices")
    hw.add_argument(
        "--devices_per_host", type=int, help="devices per host [default: the hardware's, 8 GPUs / 4-8 TPU chips]"
    )
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="meshes to show [default: 10]")
    out.add_argument(
        "--verify", type=int, default=0, metavar="K", help="compile the best K plans (abstract inputs) and compare"
    )
    out.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    out.add_argument("--png", metavar="PATH", help="write a chart: memory pie per mesh and predicted step time")
    return p


def _pipeline(args, cfg: config.TrainConfig) -> tuple:
    """The pipeline flags and --pp (None for auto), checked as `meshlm train` checks them."""
    from meshlm.job import pipeline_flags
    from meshlm.ops.pipeline import check

    flags = pipeline_flags(cfg)
    if args.pp == "auto":
        if args.mesh_dim:
            raise UsageError(
                f"--pp=auto searches the meshes, --mesh_dim={args.mesh_dim} names one; give --pp=N "
                "(or pp:N in --mesh_dim) with it, or leave --mesh_dim out"
            )
        check(flags.schedule, 1, flags.microbatches or 2, flags.virtual_stages)  # names and signs
        return flags, None
    try:
        pp = int(args.pp)
    except ValueError:
        raise UsageError(f"--pp={args.pp}: give a number of pipeline stages or auto") from None
    if pp < 1:
        raise UsageError(f"--pp={pp} must be a positive integer (or auto)")
    return flags, pp


def _check_pipeline(flags, pp: int, n_layers: int, batch_size: int, grad_accum: int) -> None:
    """`meshlm train`'s checks of the pipeline flags, on the mesh's pp alone (the data axes come later)."""
    from meshlm.plan.job import pipeline_problem as problem

    found = problem(flags, MeshShape(pp=pp), n_layers, batch_size, grad_accum) if pp > 1 else None
    if found:
        raise UsageError(found)


def _device_count(args, per_host_default: int | None) -> tuple[int, int | None]:
    """(devices, devices per host): --devices, or --hosts × --devices_per_host (the hardware's host
    size when not given); devices per host stays None (the hardware's) unless a flag sets it."""
    hosts, per_host, n = args.hosts, args.devices_per_host, args.devices
    for flag, value in (("hosts", hosts), ("devices_per_host", per_host), ("devices", n)):
        if value is not None and value <= 0:
            raise UsageError(f"--{flag}={value} must be a positive integer")
    if hosts is None:
        return (8 if n is None else n), per_host
    if per_host is None:
        if n is not None:
            if n % hosts:
                raise UsageError(
                    f"--devices={n} is not divisible by --hosts={hosts}; give --devices a multiple of {hosts}"
                )
            return n, n // hosts
        if per_host_default is None:
            raise UsageError(f"--hosts={hosts} on --hardware=cpu needs --devices_per_host (or --devices)")
        per_host = per_host_default
    total = hosts * per_host
    if n is not None and n != total:
        raise UsageError(f"--devices={n} but --hosts × --devices_per_host = {total}; give one or make them agree")
    return total, per_host


def run(argv: list[str]) -> int:
    """Parse flags, plan, print; raises UsageError for bad input (the CLI prints it and exits 2).

    With --verify and several processes (flags or JAX_* variables, as `meshlm train`), each process
    runs this in a supervised child, joins `jax.distributed` and compiles over all processes' devices;
    process 0 prints."""
    from meshlm import distributed
    from meshlm.plan.hardware import CATALOG, hardware_key
    from meshlm.platform import configure_devices

    raw = list(argv)
    argv, overrides = split_model_overrides(list(argv))
    flags = parser()
    args = flags.parse_args(argv)
    cfg = train_config(args, overrides, drop=PLAN_FLAGS, given=flags.given)
    if args.top <= 0:
        raise UsageError(f"--top={args.top} must be a positive integer")
    if args.verify < 0:
        raise UsageError(f"--verify={args.verify} must be ≥ 0 (the number of plans to compile)")
    if args.optimizer != "adamw":
        raise UsageError(f"--optimizer={args.optimizer}: meshlm trains with adamw only")
    key = hardware_key(args.hardware)
    n_devices, per_host = _device_count(args, CATALOG[key].devices_per_host if key in CATALOG else None)
    cluster = distributed.resolve(args.coordinator_address, args.num_processes, args.process_id, args.peer_timeout)
    if not (args.verify and cluster.multi_process):
        if args.verify or key == "cpu":
            # Effective only if JAX has not started yet (a fresh process): --verify compiles on these
            # devices, and the CPU's probes measure collectives and matmuls over them.
            configure_devices(n_devices)
        return _run(args, cfg, overrides, n_devices, per_host, key, cluster.process_id == 0)
    if n_devices % cluster.num_processes:
        raise UsageError(f"--devices={n_devices} does not split over --num_processes={cluster.num_processes}")
    # Each process brings its share of the devices.
    return distributed.run(
        "plan",
        raw,
        cluster,
        lambda main: _run(args, cfg, overrides, n_devices, per_host, key, main),
        n_devices // cluster.num_processes,
        connect_timeout=args.connect_timeout,
    )


def _run(args, train_cfg, overrides: dict, n_devices: int, per_host: int | None, key: str, prints: bool) -> int:
    from meshlm import job as joblib
    from meshlm.mesh import resolve_mesh_shape
    from meshlm.plan import report, search
    from meshlm.plan.hardware import resolve_hardware, with_peak

    policy = joblib.resolve_policy(train_cfg, backend=key if key == "cpu" else "accelerator")
    cfg, _ = joblib.resolve_model(train_cfg)
    dtype = policy.dtype
    flags, pp = _pipeline(args, train_cfg)
    only = resolve_mesh_shape(args.mesh_dim, None, False, n_devices, pp) if args.mesh_dim else None
    if only is not None:
        pp = only.pp  # --pp, or pp:N in the named --mesh_dim
    elif pp is not None:
        resolve_mesh_shape(None, None, False, n_devices, pp)  # train's check that pp divides the devices
    if pp is not None:
        _check_pipeline(flags, pp, cfg.n_layers, args.batch_size, args.grad_accum)
    if only is not None:  # the mesh the user named gets train's checks and train's messages
        joblib.check_mesh(train_cfg, only, cfg)
    hw = resolve_hardware(args.hardware, n_devices, dtype, per_host)
    hw = with_peak(hw, args.peak_tflops)
    job = joblib.plan_job(train_cfg, cfg, policy, n_devices)
    pps = search.auto_pps(job) if pp is None else (pp,)
    plans, rejected = search.search(job, hw, only, pps)

    if args.verify:
        from meshlm.explain.verify import verify

        verify(job, plans, args.verify, hw.name)
    if not prints:
        return 0
    model_flags = [
        *([f"--model={args.model or 'tiny'}"] if args.model or not args.init_from else []),
        *([f"--init_from={args.init_from}"] if args.init_from else []),
        *(f"--model.{k}={v}" for k, v in overrides.items()),
    ]
    if args.png:
        path = report.write_png(args.png, job, hw, plans, args.top)
    if args.json:
        json.dump(report.to_json(job, hw, plans, rejected, model_flags), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        report.print_report(job, hw, plans, model_flags, args.top)
        if args.png:
            print(f"chart: {path}")
    return 0
