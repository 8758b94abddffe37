"""How plans are shown: a terminal table (rich), a JSON document for scripts, a PNG chart (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshlm.models.configs import count_params
from meshlm.plan.hardware import Hardware
from meshlm.plan.job import Job
from meshlm.plan.search import Plan

PIE = ("params", "gradients", "optimizer", "activations", "temporaries")


def train_command(job: Job, plan: Plan, model_flags: list[str], hw: Hardware | None = None) -> str:
    """The `meshlm train` line that runs this plan (on CPU with `--devices`, the simulated devices it
    needs, and a pinned peak with the `--peak_tflops` the plan used). The remat policy and
    --grad_accum are the plan's own (what `--remat=auto` chose on this mesh)."""
    job = plan.job
    parts = ["meshlm train", *model_flags, f"--mesh_dim={plan.mesh_dim}"]
    if hw is not None and hw.name == "cpu":
        parts.append(f"--devices={job.n_devices}")
    if plan.shape.pp > 1:
        parts += job.pipeline.flags(plan.shape.pp)
    parts += [f"--batch_size={job.batch_size}", f"--seq_len={job.seq_len}"]
    if job.grad_accum > 1:
        parts.append(f"--grad_accum={job.grad_accum}")
    parts += [f"--dtype={job.policy.dtype}", f"--param_dtype={job.policy.param_dtype}", f"--remat={job.policy.remat}"]
    if hw is not None and hw.peak_source.startswith("--peak_tflops="):
        parts.append(hw.peak_source)
    return " ".join(parts)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}" if abs(n) >= 1e7 else f"{n / 1e9:.2g}"


def _pie(memory: dict) -> str:
    """ "a + b + c + d + e" of the PIE parts; a negative part (temporaries where on-chip memory holds
    gradients or activations at the peak) as "- e"."""
    parts = [_gb(memory[PIE[0]])]
    for key in PIE[1:]:
        parts.append(f"- {_gb(-memory[key])}" if memory[key] < 0 else f"+ {_gb(memory[key])}")
    return " ".join(parts)


def _links(hw: Hardware) -> str:
    fast = f"{hw.fast_name} {hw.fast_bandwidth / 1e9:.3g} GB/s"
    if (hw.slow_name, hw.slow_bandwidth) == (hw.fast_name, hw.fast_bandwidth):
        return fast  # simulated CPU devices: one kind of link
    return f"{fast}, {hw.slow_name} {hw.slow_bandwidth / 1e9:.3g} GB/s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


# ------------------------------------------------------------------------------------------- JSON


def _operator_json(op) -> dict[str, Any]:
    return {
        "name": op.name,
        "notation": op.notation,
        "flops_per_device": op.flops,
        "compute_seconds": op.compute_s,
        "communication_seconds": op.comm_s,
        "arithmetic_intensity_flops_per_byte": op.intensity,
        "hardware_intensity_flops_per_byte": op.ridge,
        "link": op.link or None,
        "communication_bound": op.comm_bound,
        "fix": op.fix or None,
        "collectives": [
            {
                "kind": c.kind,
                "axes": list(c.axes),
                "payload_bytes": c.payload,
                "count_per_step": c.count,
                "what": c.what,
            }
            for c in op.collectives
        ],
    }


def plan_json(job: Job, plan: Plan, model_flags: list[str], rank: int, hw: Hardware | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rank": rank,
        "mesh_dim": plan.mesh_dim,
        "mesh": plan.shape.as_dict(),
        "command": train_command(job, plan, model_flags, hw),
        "fits": plan.fits,
        "remat": plan.job.policy.remat,
        "grad_accum": plan.job.grad_accum,
        "axes_inside_fast_domain": {axis: inner for axis, (inner, _) in plan.placement.items()},
        "predicted": {
            "memory_bytes_per_device": plan.memory.as_dict(),
            "temporaries_bytes_per_device": plan.memory.temporaries_detail,
            "collective_bytes_per_device_per_step": plan.collective_bytes,
            "step_seconds": plan.time.step_s,
            "compute_seconds": plan.time.compute_s,
            "communication_seconds": plan.time.comm_s,
            "exposed_communication_seconds": plan.time.exposed_comm_s,
            "tokens_per_second": plan.time.tokens_per_s,
            "mfu": plan.time.mfu,
        },
        "operators": [_operator_json(op) for op in plan.operators],
    }
    if plan.pipeline is not None:
        out["pp"] = plan.shape.pp
        out["pipeline"] = plan.pipeline.as_dict()
    if plan.compiled:
        c = plan.compiled
        out["compiled"] = {
            "compiled_for": c["compiled_for"],
            "compile_seconds": c["compile_seconds"],
            "memory_bytes_per_device": c["peak_memory_bytes"],
            "collective_bytes_per_device_per_step": c["collective_bytes"],
        }
        out["error_percent"] = {
            "memory_bytes_per_device": c["error_percent"]["peak_memory"],
            "collective_bytes_per_device_per_step": c["error_percent"]["collective_bytes"],
        }
        if "stage_transfer_bytes" in c:
            out["compiled"]["stage_transfer_bytes_per_device_per_step"] = c["stage_transfer_bytes"]
            out["error_percent"]["stage_transfer_bytes_per_device_per_step"] = c["error_percent"]["stage_transfers"]
    return out


def to_json(job: Job, hw: Hardware, plans: list[Plan], rejected: dict[str, str], model_flags: list[str]) -> dict:
    c = job.cfg
    return {
        "job": {
            "model": " ".join(model_flags),
            "parameters": c.num_params(),
            "n_layers": c.n_layers,
            "batch_size": job.batch_size,
            "seq_len": job.seq_len,
            "grad_accum": job.grad_accum,
            "devices": job.n_devices,
            "dtype": job.policy.dtype,
            "param_dtype": job.policy.param_dtype,
            "remat": job.policy.remat,
            "tokens_per_step": job.tokens,
            "pipeline": {
                "schedule": job.pipeline.schedule,
                "microbatches": job.pipeline.microbatches,
                "virtual_stages": job.pipeline.virtual_stages,
            },
        },
        "hardware": {
            "name": hw.name,
            "peak_flops_per_second": hw.peak_flops(job.policy.dtype),
            "peak_source": hw.peak_source,
            "memory_bytes": hw.hbm_bytes,
            "memory_fraction": hw.memory_fraction,
            "memory_bytes_per_second": hw.hbm_bandwidth,
            "fast_link": hw.fast_name,
            "fast_link_bytes_per_second": hw.fast_bandwidth,
            "slow_link": hw.slow_name,
            "slow_link_bytes_per_second": hw.slow_bandwidth,
            "fast_domain_devices": hw.fast_domain,
            "source": hw.source,
        },
        "recommended": train_command(job, plans[0], model_flags, hw),
        "plans": [plan_json(job, p, model_flags, i + 1, hw) for i, p in enumerate(plans)],
        "rejected_meshes": rejected,
    }


# ------------------------------------------------------------------------------------------- table


def print_report(job: Job, hw: Hardware, plans: list[Plan], model_flags: list[str], top: int, console=None) -> None:
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or a pipe: wide enough for one row per mesh
            console = Console(width=160)
    _print_job_line(job, hw, model_flags, console)
    console.print(_mesh_table(job, plans, top))
    first_staged = next((p for p in plans[:top] if p.pipeline), None)
    if first_staged is not None:
        print_stages(first_staged, console)

    best = plans[0]
    console.print(_operator_table(best))
    for op in best.comm_bound:
        console.print(f"{op.name} is communication-bound on {op.link}: {op.fix}", highlight=False)
    console.print(f"recommended: [bold]{train_command(job, best, model_flags, hw)}[/]", highlight=False, soft_wrap=True)


def _print_job_line(job: Job, hw: Hardware, model_flags: list[str], console) -> None:
    """The report's first lines: the model, batch, devices and hardware, and the peak MFU is measured against."""
    c, run = job.cfg, job.policy
    console.print(
        f"[bold]{' '.join(model_flags)}[/]: {count_params(c.num_params())} parameters; batch {job.batch_size} × "
        f"seq {job.seq_len} on {job.n_devices} × {hw.name} ({hw.peak_flops(run.dtype) / 1e12:.3g} TFLOP/s "
        f"{run.dtype}, {hw.hbm_bytes / 1e9:.3g} GB{' = ' + hw.memory_note if hw.memory_note else ''}, {_links(hw)} per "
        f"device); remat {run.remat}",
        highlight=False,
    )
    console.print(
        f"MFU peak: {hw.peak_flops(run.dtype) / 1e12:.3g} TFLOP/s per device ({hw.peak_source})", highlight=False
    )


def _mesh_table(job: Job, plans: list[Plan], top: int):
    """The table of the best `top` meshes: one row per plan, with pipeline, remat and compiled columns
    where any shown plan has them."""
    from rich.table import Table

    shown = plans[:top]
    verified = any(p.compiled for p in shown)
    staged = any(p.pipeline for p in shown)
    onchip = any(p.memory.temporaries < 0 for p in shown)
    table = Table(
        title=f"{len(plans)} meshes, best {min(top, len(plans))}; memory in GB per device "
        "(params + gradients + optimizer + activations + temporaries"
        + ("; temporaries below 0: gradients or activations held in on-chip memory at the peak" if onchip else "")
        + ")"
    )
    searched = job.policy.remat == "auto"  # each row's policy (and micro-batches) is the search's
    columns = [
        "#",
        "mesh_dim",
        *(("pp", "bubble", "xfer GB") if staged else ()),
        *(("remat",) if searched else ()),
        "memory",
        "pie",
        "fits",
        "step s",
        "tokens/s",
        "MFU",
        "comm-bound",
    ]
    for col in columns:
        table.add_column(col, justify="left" if col in ("mesh_dim", "pp", "pie", "comm-bound") else "right")
    if verified:
        for col in ("compiled GB", "mem err", "coll err", *(("xfer err",) if staged else ())):
            table.add_column(col, justify="right")
    for i, p in enumerate(shown, 1):
        table.add_row(*_mesh_row(job, i, p, staged, searched, verified))
    return table


def _mesh_row(job: Job, i: int, p: Plan, staged: bool, searched: bool, verified: bool) -> list[str]:
    """The cells of plan `p`, ranked `i`, in `_mesh_table`'s columns."""
    m = p.memory.as_dict()
    row = [str(i), p.mesh_dim]
    if staged:
        pl = p.pipeline
        row += (
            [
                f"{pl.pp} {pl.schedule.name} M={pl.microbatches}"
                + (f" V={pl.schedule.virtual}" if pl.schedule.virtual > 1 else ""),
                f"{pl.bubble:.0%}",
                _gb(pl.transfer_bytes),
            ]
            if pl
            else ["-", "-", "-"]
        )
    if searched:
        row.append(p.job.policy.remat + (f" ×{p.job.grad_accum}" if p.job.grad_accum != job.grad_accum else ""))
    row += [
        _gb(m["total"]),
        _pie(m),
        "yes" if p.fits else "[red]no[/]",
        f"{p.time.step_s:.3g}",
        f"{p.time.tokens_per_s:,.0f}",
        f"{p.time.mfu:.0%}",
        ", ".join(op.name for op in p.comm_bound) or "-",
    ]
    if verified:
        comp = p.compiled
        row += (
            [
                _gb(comp["peak_memory_bytes"]),
                _pct(comp["error_percent"]["peak_memory"]),
                _pct(comp["error_percent"]["collective_bytes"]),
            ]
            if comp
            else ["", "", ""]
        )
        if staged:
            row.append(_pct(comp["error_percent"].get("stage_transfers")) if comp else "")
    return row


def _operator_table(best: Plan):
    """The operators of the best plan: FLOPs, bytes sent, arithmetic intensity against the hardware's, and
    what bounds each."""
    from rich.table import Table

    ops = Table(
        title=f"operators of --mesh_dim={best.mesh_dim}, per device per step "
        "(intensity: FLOPs per byte sent on its busiest link)"
    )
    for col in ("operator", "sharding", "TFLOPs", "comm GB", "intensity", "hardware", "bound"):
        ops.add_column(col, justify="right" if col in ("TFLOPs", "comm GB", "intensity", "hardware") else "left")
    for op in best.operators:
        sent = sum(col.total for col in op.collectives)
        ops.add_row(
            op.name,
            op.notation,
            f"{op.flops / 1e12:.3g}",
            f"{sent / 1e9:.3g}",
            "-" if op.intensity is None else f"{op.intensity:,.0f}",
            "-" if op.ridge is None else f"{op.ridge:,.0f} {op.link}",
            "[red]communication[/]" if op.comm_bound else ("compute" if op.flops else "-"),
        )
    return ops


def print_stages(plan: Plan, console) -> None:
    """The pipeline of one pp plan: its schedule, bubble, transfers and each stage's memory."""
    from rich.table import Table

    pl = plan.pipeline
    assert pl is not None, "print_stages is for a pp plan"
    s = pl.schedule
    console.print(
        f"pipeline of {plan.shape.flags}: {s.name}, {s.pp} stages"
        + (f" × {s.virtual} virtual" if s.virtual > 1 else "")
        + f", {s.microbatches} microbatches, {s.clocks} clocks ({pl.forward_clocks} with a forward, "
        f"{pl.backward_clocks} with a backward); bubble {pl.bubble:.1%} with the predicted clock times "
        f"(the schedule's {s.bubble():.1%} at backward = 2 × forward; (p-1)/(m·v+p-1) = "
        f"{s.theoretical_bubble():.1%}); idle ranks compute on a trash slot, so the bubble costs "
        "compute time",
        highlight=False,
    )
    console.print(
        f"stage transfers: {pl.forward_clocks + pl.backward_clocks} messages of "
        f"{pl.slot_bytes / 1e6:.3g} MB per device per step ({pl.transfer_bytes / 1e9:.3g} GB), "
        f"{pl.transfer_s:.3g} s on {pl.link}; embedding and head: replicated on every stage, every "
        "rank runs the head in each backward clock",
        highlight=False,
    )
    table = Table(
        title=f"stages of {plan.shape.flags} (every rank allocates the busiest rank's stash: "
        f"{s.act_slots} + 1 trash slots)"
    )
    for col in ("rank", "layers", "in flight", "memory GB", "memory with own stash GB"):
        table.add_column(col, justify="left" if col == "layers" else "right")
    worst = pl.worst.rank
    for st in pl.stages:
        layers = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in st.layers)
        table.add_row(
            f"{st.rank}" + (" (limits)" if st.rank == worst else ""),
            layers,
            str(st.in_flight),
            _gb(st.memory_bytes),
            _gb(st.needs_bytes),
        )
    console.print(table)


# --------------------------------------------------------------------------------------------- PNG


def write_png(path: str | Path, job: Job, hw: Hardware, plans: list[Plan], top: int) -> Path:
    """The chart of `figure` as a PNG, cropped to what it draws (legends included)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(job, hw, plans, top).savefig(path, bbox_inches="tight")
    return path


def figure(job: Job, hw: Hardware, plans: list[Plan], top: int):
    """Stacked bars of each mesh's memory pie (device memory as a line, or a note when it is far above
    them) beside its predicted step time; the legends sit under the panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = plans[:top]
    labels = [
        p.label + (f" {p.pipeline.schedule.name}" if p.pipeline else "") + ("" if p.fits else " (no fit)")
        for p in shown
    ]
    fig = Figure(figsize=(max(8, 0.7 * len(shown) + 4), 4.5), dpi=100)
    FigureCanvasAgg(fig)
    mem, step = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(shown)
    for part in PIE:
        values = [p.memory.as_dict()[part] / 1e9 for p in shown]
        mem.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    tallest = max(bottom, default=0.0)
    device_gb = hw.hbm_bytes / 1e9
    if tallest > 0 and device_gb > 4 * tallest:  # the line would squash the bars flat: say it instead
        mem.set_ylim(0, tallest * 1.25)
        mem.text(
            0.02,
            0.97,
            f"{hw.name} memory: {device_gb:.3g} GB per device (above this scale)",
            transform=mem.transAxes,
            va="top",
            fontsize=8,
        )
    else:
        mem.axhline(device_gb, color="black", linestyle="--", linewidth=1, label=f"{hw.name} memory")
    mem.set_ylabel("GB per device")
    mem.set_title("memory per device")
    compute = [p.time.compute_s for p in shown]
    step.bar(labels, compute, label="compute", color="tab:green")
    step.bar(
        labels,
        [p.time.exposed_comm_s for p in shown],
        bottom=compute,
        label="exposed communication",
        color="tab:orange",
    )
    if any(p.pipeline for p in shown):  # the share of compute the pipeline bubble takes
        bubble = [p.time.compute_s * p.pipeline.bubble if p.pipeline else 0.0 for p in shown]
        step.bar(labels, bubble, color="none", edgecolor="black", hatch="//", linewidth=0.5, label="pipeline bubble")
    step.set_ylabel("predicted seconds per step")
    step.set_title("step time")
    for ax in (mem, step):
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        ax.set_xlabel("--mesh_dim (dp,fsdp,tp,sp)" + (", pp stages" if any(p.pipeline for p in shown) else ""))
        # Legends under the panels, never over the bars; the saved figure grows to hold them.
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.42), ncol=3, frameon=False)
    fig.suptitle(
        f"{count_params(job.cfg.num_params())} parameters, batch {job.batch_size} × {job.seq_len} on "
        f"{job.n_devices} × {hw.name}"
    )
    fig.tight_layout()
    return fig
