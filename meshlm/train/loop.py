"""`train(cfg)`: a run of the `Trainer`, in named phases over the library pieces.

Set up (`meshlm.train.setup`: job, what trains, data, optimizer), restore or init
(`meshlm.train.restore`), then each step with its hooks (`meshlm.train.hooks`: log, profile, NaN watch,
evaluate, save), then finish (the summary). A run whose checkpoint is already at `--steps` stops before
any data or compile work, saying so (`meshlm.train.report` words every message about the run).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax

from meshlm import distributed
from meshlm.checkpoint.manager import Checkpointer
from meshlm.config import TrainConfig, profile_range
from meshlm.flops import model_flops_per_token
from meshlm.ops.kernels import gpu_capability
from meshlm.optimizer import lr_schedule
from meshlm.train import metrics as M
from meshlm.train import report
from meshlm.train import step as train_step  # called through the module: tests replace its functions
from meshlm.train.announce import run_lines
from meshlm.train.console import TrainProgress, run_console
from meshlm.train.diagnostics import DocumentsWatch, NonFiniteWatch, StepProfiler
from meshlm.train.evaluate import Evaluator, eval_steps
from meshlm.train.hooks import Hook, StepEnd
from meshlm.train.hooks.checkpoints import CheckpointHook
from meshlm.train.hooks.documents import DocumentsHook
from meshlm.train.hooks.evaluation import EvaluationHook
from meshlm.train.hooks.log import LogHook, StepClock
from meshlm.train.hooks.nan_watch import NanWatchHook
from meshlm.train.hooks.profiler import ProfilerHook
from meshlm.train.restore import restore_or_init
from meshlm.train.run_lock import run_folder_lock
from meshlm.train.setup import Run, latest_step, resolve, set_up, warmup_note, write_run_files
from meshlm.train.state import TrainState


class StopRequest:
    """SIGTERM / SIGINT ask the loop to save at the next step boundary and exit cleanly."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, _frame):
        self.requested = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def train(cfg: TrainConfig, console=None) -> dict[str, Any]:
    """Run a training job end to end; returns a summary (first and last loss, throughput, paths).

    With several processes (the cluster flags or a cluster's environment) this process joins the
    others first; an error in any of them is one line and ends them all."""
    cfg.validate()
    cluster = distributed.resolve(cfg.coordinator_address, cfg.num_processes, cfg.process_id, cfg.peer_timeout)
    return distributed.run_here(cluster, lambda main: _locked(cfg, console, main), cfg.devices, cfg.connect_timeout)


def _locked(cfg: TrainConfig, console, main: bool) -> dict[str, Any]:
    """The run holding the run folder's lock (process 0's), taken before anything reads or writes it."""
    with run_folder_lock(cfg.output_dir, enabled=main):
        return Trainer(cfg, console).run()


class Trainer:
    """One run: `run` is the loop; each phase is a method, each thing done around a step a hook."""

    def __init__(self, cfg: TrainConfig, console=None):
        self.cfg, self.is_main = cfg, jax.process_index() == 0  # logs, progress and files: process 0 only
        self.console = console or run_console(quiet=not self.is_main)
        self.stop = StopRequest()

    def run(self) -> dict[str, Any]:
        run = self.set_up()
        if not isinstance(run, Run):
            return run  # already at --steps
        checkpointer = Checkpointer(run.out / "checkpoints", keep=self.cfg.keep, save_every=self.cfg.save_every)
        state = restore_or_init(run, checkpointer, self.console)
        first_step = int(state.step) + 1
        step_fn = train_step.make_train_step(
            run.job.placement,
            run.optimizer,
            lr_schedule(run.opt_cfg),
            self.cfg.grad_accum,
            run.job.pipeline,
            run.trainable,
        )
        perm = train_step.sequence_permutation(run.job.placement, self.cfg.seq_len)
        self.make_hooks(run, checkpointer, state, first_step, perm)
        with self.stop, self.logger.closed_on_error(), self.progress, contextlib.closing(run.loader):
            for step in range(first_step, self.cfg.steps + 1):
                host_batch = self.clock.next_batch(run.loader)  # read ahead on a thread; the wait is logged
                state, end = self.step(run, step_fn, state, step, first_step, host_batch, perm)
                if any(hook.after_step(end) for hook in self.after) or self.stop.requested:
                    break
        return self.finish(run, first_step)

    def set_up(self) -> Run | dict[str, Any]:
        """The job, what trains, the data and the optimizer, announced; or the summary of a finished run."""
        cfg, console = self.cfg, self.console
        job, trainable = resolve(cfg)
        if cfg.mp_mesh_dim:
            console.print(f"--mp_mesh_dim={cfg.mp_mesh_dim}{' --fsdp' if cfg.fsdp else ''} is --mesh_dim={job.shape}")
        latest = latest_step(Path(cfg.output_dir) / "checkpoints")
        if latest is not None and latest >= cfg.steps:  # a finished run: say so, before any data or compile work
            console.print(report.already_done(cfg.output_dir, latest, cfg.steps))
            return {
                "interrupted": None,
                "already_done": True,
                "checkpoint_step": latest,
                "first_step": None,
                "last_step": latest,
                "steps_run": 0,
                "first_loss": None,
                "final_loss": None,
                "compile_seconds": None,
                "steps": cfg.steps,
                "mesh_dim": str(job.shape),
                "output_dir": str(Path(cfg.output_dir)),
                "history": [],
                "evals": [],
            }
        run = set_up(cfg, job, trainable, self.is_main)
        for line in ([note] if (note := warmup_note(cfg, run.opt_cfg)) else []) + run_lines(run):
            console.print(line)
        return run

    def make_hooks(self, run: Run, checkpointer: Checkpointer, state: TrainState, first_step: int, perm) -> None:
        """The hooks around each step, in the order they run, with the metrics logger and the clock."""
        cfg, console, model_cfg, is_main = self.cfg, self.console, run.job.model, self.is_main
        evaluator = Evaluator(run.job.placement, run.eval_batches, perm) if run.eval_batches is not None else None
        peak, peak_source = M.resolve_peak(cfg.peak_tflops, run.job.policy.dtype)
        console.print(f"MFU peak: {peak / 1e12:.3g} TFLOP/s per device ({peak_source})")
        self.logger = M.MetricsLogger(
            run.out,
            flops_per_token=model_flops_per_token(model_cfg, cfg.seq_len),
            peak_flops_per_device=peak,
            n_devices=jax.device_count(),
            total_steps=cfg.steps,
            log_every=cfg.log_every,
            enabled=is_main,
            tracker=cfg.tracker,
            run_config=run.meta,
        )
        write_run_files(run)
        watch = NonFiniteWatch(model_cfg.vocab_size)
        watch.start(first_step, state.params)  # what it says of the cause needs the weights the run starts from
        profiler = StepProfiler(
            profile_range(cfg.profile_steps) if cfg.profile_steps else None, run.out / "profile", is_main
        )
        documents = DocumentsWatch(
            run.job.model,
            run.job.policy,
            cfg.seq_len,
            ring=run.job.shape.sp > 1,
            platform=jax.devices()[0].platform,
            gpu_capability=gpu_capability(),
        )
        self.clock = StepClock(cfg.batch_size * cfg.seq_len)
        self.progress = TrainProgress(cfg.steps, enabled=is_main, console=console)
        self.log = LogHook(self.logger, self.progress, self.clock, cfg.log_every, cfg.steps, console, is_main)
        self.profiler = ProfilerHook(profiler, first_step, console)
        self.checkpoints = CheckpointHook(
            checkpointer, run.trainable, run.loader, run.meta, self.stop, first_step, cfg.steps
        )
        self.nan_watch = NanWatchHook(watch, self.checkpoints, cfg.log_every, run.out, console)
        evaluation = (
            [
                EvaluationHook(
                    evaluator,
                    eval_steps(cfg.eval_every, cfg.steps),
                    run.trainable,
                    self.logger,
                    self.clock,
                    self.stop,
                    console,
                    is_main,
                )
            ]
            if evaluator is not None
            else []
        )
        self.evals = evaluation[0].evals if evaluation else []
        self.before: list[Hook] = [DocumentsHook(documents, console, is_main), self.profiler]
        self.after: list[Hook] = [self.log, self.profiler, self.nan_watch, *evaluation, self.checkpoints]

    def step(self, run: Run, step_fn, state: TrainState, step: int, first_step: int, host_batch: dict, perm):
        """One train step on the mesh, the hooks before it called; the first one's time is the compile."""
        batch = train_step.put_batch(run.job.placement, host_batch, perm)
        for hook in self.before:
            hook.before_step(step, host_batch)
        t0 = time.perf_counter()
        state, step_metrics = step_fn(state, batch)
        self.clock.tokens_since += self.clock.tokens_per_step
        if step == first_step:
            jax.block_until_ready(step_metrics)
            self.clock.compile_seconds = time.perf_counter() - t0
            self.clock.restart()  # throughput excludes the compile
            self.console.print(f"compiled and ran step {step} in {self.clock.compile_seconds:.1f}s")
        return state, StepEnd(step, state, step_metrics, host_batch, step == first_step)

    def finish(self, run: Run, first_step: int) -> dict[str, Any]:
        """The trace and the last save closed, the metrics files and plot written; the summary."""
        cfg, out, history = self.cfg, run.out, self.log.history
        self.profiler.finish()
        self.checkpoints.finish()
        self.logger.close(title=f"{cfg.model or run.job.init_source or 'tiny'} on {run.job.shape.flags}")
        saved_at, diverged = self.checkpoints.saved_at, self.nan_watch.diverged
        summary = {
            "interrupted": self.stop.requested,
            "diverged": diverged.step if diverged else None,
            "already_done": False,
            "checkpoint_step": saved_at,
            "first_step": first_step,
            "last_step": saved_at,
            "steps_run": saved_at - first_step + 1,
            "first_loss": history[0]["loss"] if history else None,
            "final_loss": history[-1]["loss"] if history else None,
            "compile_seconds": self.clock.compile_seconds,
            "steps": cfg.steps,
            "mesh_dim": str(run.job.shape),
            "output_dir": str(out),
            "history": history,
            "evals": self.evals,
        }
        if self.is_main and not diverged:
            for line in report.summary_lines(
                first_step=first_step,
                last_step=saved_at,
                total_steps=cfg.steps,
                history=history,
                evals=self.evals,
                stopped=self.stop.requested,
                output_dir=cfg.output_dir,
                checkpoint=out / "checkpoints" / str(saved_at) if saved_at >= first_step else None,
                chat=run.loader.chat_data is not None,
            ):
                self.console.print(line)
        return summary
