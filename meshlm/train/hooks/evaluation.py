"""Evaluation every `--eval_every` steps and after the last, on the weights `Trainable.merged` gives."""

from __future__ import annotations

import time

import jax

from meshlm.train.console import print_metrics_line
from meshlm.train.evaluate import Evaluator
from meshlm.train.hooks import Hook, StepEnd
from meshlm.train.hooks.log import StepClock
from meshlm.train.metrics import MetricsLogger
from meshlm.train.trainable import Trainable


class EvaluationHook(Hook):
    def __init__(
        self,
        evaluator: Evaluator,
        due,
        trainable: Trainable,
        logger: MetricsLogger,
        clock: StepClock,
        stop,
        console,
        is_main: bool,
    ):
        self.evaluator, self.due, self.trainable, self.logger, self.clock = evaluator, due, trainable, logger, clock
        self.stop, self.console, self.is_main = stop, console, is_main
        self.evals: list[dict] = []

    def after_step(self, end: StepEnd) -> bool:
        if not self.due(end.step) or self.stop.requested:
            return False
        jax.block_until_ready(end.state.params)  # the train steps' time stays theirs ...
        t_eval = time.perf_counter()
        result = self.logger.log_eval(end.step, self.evaluator(self.trainable.merged(end.state.params)))
        self.evals.append(result)
        if self.is_main:
            print_metrics_line(result, console=self.console)
        self.clock.leave_out(time.perf_counter() - t_eval)  # ... and the evaluation's is left out of tok/s
        return False
