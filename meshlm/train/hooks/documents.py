"""The warning when a batch holds more documents in a row than the attention kernel keeps apart."""

from __future__ import annotations

from meshlm.train.diagnostics import DocumentsWatch
from meshlm.train.hooks import Hook


class DocumentsHook(Hook):
    def __init__(self, watch: DocumentsWatch, console, is_main: bool):
        self.watch, self.console, self.is_main = watch, console, is_main

    def before_step(self, step: int, host_batch: dict) -> None:
        if (warning := self.watch.check(host_batch)) and self.is_main:
            self.console.print(warning)
