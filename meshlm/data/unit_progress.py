"""The progress bar and summary of `meshlm.data.prepare`: documents/s, tokens/s, MB/s and the time left
(from the input bytes of the units still to encode), then where the shards are and what each source gave."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

MAX_SOURCES = 20  # sources listed one per line in the summary; the rest are counted


class UnitProgress:
    """A context manager; `advance(documents, tokens, bytes)` as each chunk of a unit is written."""

    def __init__(self, console: Console, spec: str, total_bytes: int):
        self.console, self.spec = console, spec
        self.documents = self.tokens = self.bytes = 0
        self._start = time.perf_counter()
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[rates]}"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._task = self._bar.add_task(f"Tokenizing {spec}", total=max(total_bytes, 1), rates="")

    def __enter__(self) -> UnitProgress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def advance(self, documents: int, tokens: int, nbytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes
        self._bar.update(self._task, advance=nbytes, rates=self.rates())

    def rates(self) -> str:
        s = max(time.perf_counter() - self._start, 1e-9)
        return (
            f"{self.documents / s:,.0f} docs/s  {self.tokens / s / 1e6:,.2f}M tok/s  {self.bytes / s / 1e6:,.1f} MB/s"
        )

    @staticmethod
    def summary(console: Console, shards, done: int) -> None:
        """One line: where the shards are and their totals (`done` units encoded by this run), then one per source."""

        def say(line: str) -> None:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

        say(
            f"[meshlm] token shards of {shards.manifest['corpus']}: {shards.documents:,} documents, {len(shards):,} "
            f"tokens in {len(shards.units)} units ({done} encoded now) -> {shards.folder}"
        )
        sources = list(shards.tokens_per_source().items())
        for label, (documents, tokens) in sources[:MAX_SOURCES]:
            say(f"[meshlm]   {label}: {documents:,} documents, {tokens:,} tokens")
        if len(sources) > MAX_SOURCES:
            say(f"[meshlm]   ... and {len(sources) - MAX_SOURCES} more sources")
