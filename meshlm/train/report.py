"""What a training run says about itself: a resume (mesh, learning-rate schedule), a run that has
nothing left to do, a run stopped by a NaN/Inf, and the closing summary of the steps this process ran.

Every message is one line and names what to do next. The functions take plain values (the
checkpoint's metadata as `meshlm.train.loop` saves it, step numbers, paths) and return strings, so
each is tested without training.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

from meshlm.optimizer import OptimizerConfig, lr_schedule
from meshlm.train.console import plural


def meshlm_command() -> str:
    """How to run meshlm from this shell: `meshlm` where that name on PATH is this installation's command,
    else the command's own path (`.venv/bin/meshlm` from the folder `make` ran in: `make` installs it into
    `.venv`, not onto PATH), relative to the working folder when inside it."""
    script = Path(sys.executable).parent / "meshlm"
    if not script.is_file():
        return "meshlm"
    on_path = shutil.which("meshlm")
    if on_path is not None and Path(on_path).resolve() == script.resolve():
        return "meshlm"
    here = Path.cwd()
    where = script.absolute()
    return shlex.quote(str(where.relative_to(here)) if where.is_relative_to(here) else str(where))


def generate_command(output_dir: str | Path, chat: bool = False) -> str:
    """The command that samples from a run's newest checkpoint; for a run on chat data, the server whose
    chat page applies the run's chat template. Spelt as `meshlm_command` says meshlm runs here."""
    meshlm = meshlm_command()
    if chat:
        return f"{meshlm} serve --checkpoint={shlex.quote(str(output_dir))}   # then open http://127.0.0.1:8000/"
    return f"{meshlm} generate --checkpoint={shlex.quote(str(output_dir))} --prompt='def '"


def already_done(output_dir: str | Path, at_step: int, steps: int) -> str:
    """The run in `output_dir` has a checkpoint at `at_step` >= `--steps`: nothing to train."""
    where = f"already at step {at_step}" + (f", past --steps={steps}" if at_step > steps else f" (--steps={steps})")
    return (
        f"{output_dir} is {where}: nothing to train. To continue it, raise --steps (e.g. --steps={at_step + steps}); "
        f"to start another run, pass a new --output_dir; to use it, `{generate_command(output_dir)}`"
    )


def diverged(bad, last_good: int | None, output_dir: str | Path) -> str:
    """The run stopped at a NaN/Inf (`bad`: meshlm.train.diagnostics.NonFinite) without saving: what caused it
    as far as the run knows, where the last good checkpoint is, and what to change. Only a loss that was
    finite and then diverged is blamed on --lr (`NonFinite.cause`)."""
    saved = Path(output_dir) / "checkpoints" / str(last_good) if last_good is not None else None
    keep = (
        f"the last good checkpoint, {saved}, is kept: re-run to resume from it"
        if saved is not None
        else "no checkpoint was saved before it: re-run"
    )
    head = f"stopped at step {bad.step}: {bad.what()}"
    cause = bad.cause()
    if cause == "weights":
        where = (
            f"they are those of {saved}: delete that folder to resume from the checkpoint before it, or give a "
            f"new --output_dir"
            if saved is not None
            else "check the weights of --init_from"
        )
        return (
            f"{head}; the weights this run started from already held NaN/Inf, so neither the data nor --lr is "
            f"the cause: {where} (exit code 1)"
        )
    if cause == "data":
        at, token = bad.bad_ids
        return (
            f"{head}; the batch of step {at} held token id {token}, outside the model's vocabulary of "
            f"{bad.vocab_size}: the data is the cause, not --lr; check --dataset and --tokenizer; {keep} (exit code 1)"
        )
    if cause == "first step":
        return (
            f"{head} at this run's first step, computed before any update from finite weights and in-range "
            f"token ids: --lr is not the cause; check the data, and --dtype=float32 rules out bfloat16 "
            f"overflow; {keep} (exit code 1)"
        )
    first, last = bad.first_step, bad.step - 1
    finite = (
        ""
        if first is None or first > last
        else f" after finite step {last}"
        if first == last
        else f" after finite steps {first}–{last}"
    )
    return f"{head}{finite}; {keep} with a lower --lr or a --clip_norm (exit code 1)"


def saved_mesh(meta: dict) -> str | None:
    """The mesh flags a checkpoint was saved on (`mesh` in newer metadata, `mesh_dim` in all)."""
    if meta.get("mesh"):
        return str(meta["mesh"])
    return f"--mesh_dim={meta['mesh_dim']}" if meta.get("mesh_dim") else None


def resumed(where: Path, step: int, meta: dict, mesh_flags: str) -> str:
    """`resumed from <dir> at step N`, and the mesh change when the checkpoint came from another mesh."""
    line = f"resumed from {where} at step {step}"
    before = saved_mesh(meta)
    if before is not None and before != mesh_flags:
        line += f" (saved on {before}, restored onto {mesh_flags}: every array resharded as it was read)"
    return line


def schedule_of(meta: dict) -> dict | None:
    """The learning-rate schedule a checkpoint's run used: lr, warmup_steps, total_steps, min_lr_ratio."""
    if meta.get("schedule"):
        return dict(meta["schedule"])
    train = meta.get("train") or {}
    if not train.get("steps"):
        return None
    total = train.get("schedule_steps") or train["steps"]
    warmup = train["warmup_steps"] if train.get("warmup_steps") is not None else min(1000, total // 10)
    return {
        "lr": train.get("lr"),
        "warmup_steps": warmup,
        "total_steps": total,
        "min_lr_ratio": train.get("min_lr_ratio"),
    }


def schedule_change(before: dict | None, now: dict, step: int, steps: int) -> str | None:
    """One line when the resumed run lays its warm-up and decay over other steps than the checkpoint's
    run did (a larger --steps stretches the cosine), with the rate of the next step both ways and the
    flags that keep the original schedule; None when the schedule is the same."""
    if before is None or (before["total_steps"], before["warmup_steps"]) == (now["total_steps"], now["warmup_steps"]):
        return None

    def rate(s: dict) -> float:
        cfg = OptimizerConfig(
            lr=s.get("lr") or now["lr"],
            warmup_steps=s["warmup_steps"],
            total_steps=s["total_steps"],
            min_lr_ratio=s.get("min_lr_ratio") if s.get("min_lr_ratio") is not None else now["min_lr_ratio"],
        )
        return float(lr_schedule(cfg)(step))

    keep = f"--schedule_steps={before['total_steps']}"
    if before["warmup_steps"] != now["warmup_steps"]:
        keep += f" --warmup_steps={before['warmup_steps']}"
    warm = (
        (f" with {now['warmup_steps']} warm-up steps", f" with {before['warmup_steps']}")
        if before["warmup_steps"] != now["warmup_steps"]
        else ("", "")
    )
    return (
        f"the learning-rate schedule now spans {now['total_steps']} steps{warm[0]}, not the "
        f"{before['total_steps']}{warm[1]} the checkpoint was trained with: the decay "
        f"stretches to step {max(steps, now['total_steps'])} and the rate of step {step + 1} is {rate(now):.3g} instead "
        f"of {rate(before):.3g}; pass {keep} to keep the original schedule"
    )


def summary_lines(
    *,
    first_step: int,
    last_step: int,
    total_steps: int,
    history: list[dict],
    evals: list[dict],
    stopped: str | None,
    output_dir: str | Path,
    checkpoint: Path | None,
    chat: bool = False,
) -> list[str]:
    """The closing lines: the steps this process ran (not the run's total), their first and last logged
    loss, the last evaluation, the checkpoint written and what to run next."""
    ran = last_step - first_step + 1
    span = f"steps {first_step}–{last_step}" if ran > 1 else f"step {last_step}"
    head = f"stopped by {stopped} after step {last_step}" if stopped else "done"
    parts = [
        f"{head}: ran {span} ({plural(ran, 'step')}"
        + (f", resumed from step {first_step - 1})" if first_step > 1 else ")")
    ]
    if history:
        a, b = history[0], history[-1]
        if a["step"] != b["step"]:
            parts.append(f"loss {_loss(a['loss'])} (step {a['step']}) → {_loss(b['loss'])} (step {b['step']})")
        else:
            parts.append(f"loss {_loss(b['loss'])} (step {b['step']})")
    if evals:
        e = evals[-1]
        parts.append(f"eval loss {e['eval_loss']:.3f}, perplexity {e['eval_perplexity']:,.2f} (step {e['step']})")
    out = Path(output_dir)
    lines = ["; ".join(parts)]
    if checkpoint is not None:
        lines.append(
            f"checkpoint {checkpoint}; metrics in {out / 'metrics.jsonl'}, the whole run's curve in "
            f"{out / 'loss.png'}" + (f", TensorBoard in {out / 'tb'}" if (out / "tb").is_dir() else "")
        )
    if stopped:
        lines.append(f"next: the same command resumes from step {last_step}")
    elif last_step < total_steps:
        lines.append(f"next: the same command continues to step {total_steps}")
    else:
        lines.append(f"next: {generate_command(output_dir, chat)}")
    return lines


def _loss(v) -> str:
    return "-" if v is None else f"{v:.3f}"


__all__ = [
    "meshlm_command",
    "generate_command",
    "already_done",
    "saved_mesh",
    "resumed",
    "schedule_of",
    "schedule_change",
    "summary_lines",
]
