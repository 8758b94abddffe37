"""The one error type the command line turns into a single line and exit code 2, and the lookup its
messages use to point at a near name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UsageError(ValueError):
    """Bad user input: a flag, a config file, a checkpoint. The message names the fix."""


def closest(word: str, choices: Iterable[str], cutoff: float = 0.7) -> str | None:
    """The choice nearest to a misspelt `word` (difflib's similarity at least `cutoff`), or None."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return found[0] if found else None
