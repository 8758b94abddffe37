"""Every shape the generation engine compiles, chosen (and checked) before anything compiles.

Prefill: one compiled step per prompt-length bucket, `prefill_batch` prompts at a time. Decode: one
compiled step per (rows, cache slots attended) pair, so a step runs only the rows that hold busy slots
and reads only the cache prefix that holds their tokens. The engine compiles all of them at start-up,
so traffic never compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import UsageError
from meshlm.job import check_max_batch


def length_buckets(max_seq_len: int, smallest: int = 32) -> tuple[int, ...]:
    """Prompt lengths that get their own compiled prefill: powers of two, capped by the context."""
    out, n = [], smallest
    while n < max_seq_len:
        out.append(n)
        n *= 2
    return tuple(out) + (max_seq_len,)


def decode_buckets(max_batch: int, data: int, max_seq_len: int, sp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The decode step's compiled shapes: (rows, cache slots attended). A step runs only the first
    rows that hold busy slots (slots are taken lowest first) and reads only the cache prefix that
    holds their tokens, so a lone request or a short context costs what it needs, not the work of
    the whole cache. Rows: max_batch, /4, /16, ... while a multiple of the data-parallel size `data`;
    slots: 128, 512, ... (×4) below max_seq_len, then max_seq_len; the whole length when the cache
    is split over `sp` sequence-parallel ranks."""
    rows, n = [max_batch], max_batch
    while n % 4 == 0 and (n // 4) % data == 0:
        n //= 4
        rows.append(n)
    lengths, n = [], 128
    while sp == 1 and n < max_seq_len:
        lengths.append(n)
        n *= 4
    return tuple(sorted(rows)), tuple(lengths) + (max_seq_len,)


@dataclass(frozen=True)
class Shapes:
    """The engine's compiled shapes: its slots, its context, its prefill and decode buckets."""

    max_batch: int  # slots: rows of the KV cache
    max_seq_len: int  # the context: the KV cache's length
    prefill_lengths: tuple[int, ...]  # prompt-length buckets, ascending
    prefill_batch: int  # prompts per prefill
    decode_rows: tuple[int, ...]
    decode_lengths: tuple[int, ...]

    def prefill_length(self, longest: int) -> int:
        """The smallest prompt bucket that holds a prompt of `longest` tokens."""
        return next(b for b in self.prefill_lengths if b >= longest)

    def decode_shape(self, last_busy: int, reach: int) -> tuple[int, int]:
        """The smallest compiled (rows, length) that holds slot `last_busy` and cache position `reach` - 1."""
        rows = next(r for r in self.decode_rows if r > last_busy)
        return rows, next((n for n in self.decode_lengths if n >= reach), self.decode_lengths[-1])


def plan_shapes(
    model_max_seq_len: int,
    *,
    max_batch: int,
    max_seq_len: int | None,
    prefill_buckets: tuple[int, ...] | None,
    prefill_batch: int | None,
    data: int,
    sp: int,
) -> Shapes:
    """The shapes for these settings, or a UsageError that names the fix. `data` is the data-parallel
    size (rows split that many ways), `sp` the sequence-parallel size (prompts split that many ways)."""
    context = int(max_seq_len or min(model_max_seq_len, 2048))
    if context > model_max_seq_len:
        raise UsageError(f"--max_seq_len={context} exceeds the model's max_seq_len={model_max_seq_len}")
    check_max_batch(max_batch, data)
    buckets = tuple(sorted(prefill_buckets or length_buckets(context)))
    for n in buckets:
        if n < 1 or n > context:
            raise UsageError(
                f"--prefill_buckets: length {n} must be between 1 and the context, --max_seq_len={context}; "
                "drop it or raise --max_seq_len"
            )
    pieces = "the sequence-parallel ranks each take two equal pieces of it"
    if sp > 1 and context % (2 * sp):
        raise UsageError(f"--max_seq_len={context} must be divisible by 2×sp = {2 * sp}: {pieces}")
    if sp > 1 and (odd := [n for n in buckets if n % (2 * sp)]):
        raise UsageError(f"--prefill_buckets: length {odd[0]} must be divisible by 2×sp = {2 * sp}: {pieces}")
    prefill_batch = prefill_batch or data
    if prefill_batch % data:
        raise UsageError(f"prefill batch {prefill_batch} must be a multiple of dp×fsdp = {data}")
    rows, lengths = decode_buckets(max_batch, data, context, sp)
    return Shapes(max_batch, context, buckets, prefill_batch, rows, lengths)


__all__ = ["Shapes", "plan_shapes", "length_buckets", "decode_buckets"]
