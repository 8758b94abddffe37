"""Generated tokens to text, a token at a time, and stop strings found in that text, in linear time.

    text = IncrementalText(tokenizer)
    piece = text.add(token_id)      # the text this token settles ("" while a character is incomplete)
    rest = text.flush()             # at the end: whatever is still unsettled (an incomplete character)

    stops = StopMatcher(("\\nUser:",))
    start = stops.feed(piece)       # where a stop string begins (chars fed so far), or None
    stops.partial                   # how many chars at the end could begin a stop string: hold them back

Both cost time proportional to the text they are given, never to the whole reply so far nor to the
length of a stop string: `IncrementalText` decodes a short window of recent tokens, and `StopMatcher`
runs a Knuth-Morris-Pratt automaton per stop string whose table grows only as far as the text has
matched (a stop string of a million characters costs nothing until the reply starts to spell it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalText:
    """Token ids to text one at a time. A token whose bytes end inside a multi-byte character settles
    nothing until the character is complete; `flush` gives what is left at the end."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] is context decoded again with each new token
        self._read = 0  # ids before this are settled

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        now = self.tokenizer.decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before) :]
        if len(self.ids) - self._read > 8:  # never settles this way (a tokenizer that rewrites earlier text)
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before) :] if now.startswith(before) else now
        return ""

    @property
    def unsettled(self) -> list[int]:
        """The tokens whose text is not settled yet (at most a few)."""
        return self.ids[self._read :]

    def flush(self) -> str:
        """The text of the tokens not settled yet (an incomplete character shows as U+FFFD)."""
        if self._read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        now = self.tokenizer.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :] if now.startswith(before) else now


class _Automaton:
    """One stop string: the length of its longest prefix that ends the text fed so far (KMP)."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str):
        self.stop = stop
        self.fail = [0]  # fail[k]: longest proper border of stop[:k + 1]; grown only as far as needed
        self.state = 0

    def _border(self, k: int) -> int:
        """fail[k], computing the entries before it first (amortised O(1) per entry)."""
        stop, fail = self.stop, self.fail
        while len(fail) <= k:
            i, j = len(fail), fail[-1]
            while j and stop[i] != stop[j]:
                j = fail[j - 1]
            fail.append(j + 1 if stop[i] == stop[j] else 0)
        return fail[k]

    def step(self, char: str) -> bool:
        """Feed one character; True when the whole stop string has just been spelled."""
        stop, j = self.stop, self.state
        if j == len(stop):
            j = self._border(j - 1)
        while j and stop[j] != char:
            j = self._border(j - 1)
        if stop[j] == char:
            j += 1
        self.state = j
        return j == len(stop)


class StopMatcher:
    """Finds the first of several stop strings in text fed piece by piece."""

    def __init__(self, stops: Sequence[str]):
        self._automata = [_Automaton(s) for s in stops if s]
        self.fed = 0  # characters fed so far

    def feed(self, text: str) -> int | None:
        """Feed more text; the position (in all the text fed) where a stop string begins, or None.
        When several end at the same character, the one that begins first wins."""
        if not self._automata:
            self.fed += len(text)
            return None
        for char in text:
            self.fed += 1
            ends = [len(a.stop) for a in self._automata if a.step(char)]
            if ends:
                return self.fed - max(ends)
        return None

    @property
    def partial(self) -> int:
        """How many characters at the end of the text fed so far could begin a stop string."""
        return max((a.state for a in self._automata), default=0)


__all__ = ["IncrementalText", "StopMatcher"]
