"""Evaluation rows: a held-out share of the training rows (`--eval_split`) or another dataset
(`--eval_dataset`), read as the same fixed batches at every evaluation.

Held-out rows: `meshlm.data.loader.held_out_rows(num_rows, fraction)` picks `ceil(fraction *
num_rows)` rows of the packed corpus with a generator of its own (`EVAL_SEED`), so the choice depends
on the row count and the fraction alone, not on `--seed`: runs with different seeds are evaluated on
the same rows. The training loader (`DataLoader(eval_split=...)`) then shuffles only the other rows,
so a held-out row never reaches a training batch. `--eval_dataset` rows are sampled with the same
key over the whole dataset. Both are keyed orders (`meshlm.data.shuffle`), computed for the rows an
evaluation reads; a mixture's held-out rows are each source's, taken in turn.

Batches: evaluation batch b takes the rows `b*B .. b*B+B-1` of the evaluation rows (B the global
batch size), and process p of P reads only its rows `p*B/P .. (p+1)*B/P - 1` of it, the way the
training loader splits a batch. The synthetic dataset has no rows: its evaluation batches are random
tokens drawn from a stream the training batches never use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshlm.data.chat import tokenize_chat
from meshlm.data.corpus import is_synthetic
from meshlm.data.loader import pack_rows, read_rows
from meshlm.data.prepare import prepare_tokens
from meshlm.data.shuffle import EVAL_SEED, Bijection, Rows
from meshlm.errors import UsageError

DEFAULT_EVAL_BATCHES = 10  # at most this many batches per evaluation unless --eval_batches says otherwise
_SYNTHETIC_STREAM = 1 << 40  # synthetic eval batches are seeded past every training step


class EvalBatches:
    """This process's share of the `n_batches` fixed evaluation batches (`batches()`, built once).

    `tokens` and `rows` are the packed stream and the evaluation row ids (None for synthetic data);
    `source` names the flag to change when there are too few rows."""

    def __init__(
        self,
        tokens,
        rows,
        tokenizer,
        seq_len: int,
        global_batch_size: int,
        n_batches: int | None,
        process_index: int = 0,
        process_count: int = 1,
        seed: int = 0,
        source: str = "--eval_split",
        flags=None,
        read=None,
    ):
        self.tokens, self.rows, self.tokenizer, self.flags = tokens, rows, tokenizer, flags
        self.read = read  # row ids -> batch, for rows that are not one stream's (a mixture's); else read_rows
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        self.process_index, self.local_batch_size = process_index, global_batch_size // process_count
        if rows is None:
            self.n_batches = n_batches or DEFAULT_EVAL_BATCHES
        else:
            fit = len(rows) // global_batch_size
            if fit == 0 or (n_batches is not None and n_batches > fit):
                want = max(n_batches or 1, 1)
                raise UsageError(
                    f"{source} gives {len(rows)} evaluation row{'s' if len(rows) != 1 else ''} of {seq_len} + 1 "
                    f"tokens, fewer than "
                    f"{want} batch{'es' if want > 1 else ''} of --batch_size={global_batch_size}; "
                    + (
                        "raise --eval_split or lower --eval_batches or --batch_size"
                        if source.startswith("--eval_split")
                        else "use a bigger --eval_dataset or lower --eval_batches, --batch_size or --seq_len"
                    )
                )
            self.n_batches = n_batches or min(fit, DEFAULT_EVAL_BATCHES)
        self._cache: list[dict[str, np.ndarray]] | None = None

    @property
    def rows_per_eval(self) -> int:
        return self.n_batches * self.global_batch_size

    def global_rows(self, b: int) -> np.ndarray:
        """The row ids of evaluation batch `b` that this process reads (all processes: the whole batch)."""
        first = b * self.global_batch_size + self.process_index * self.local_batch_size
        return self.rows[first : first + self.local_batch_size]

    def batch(self, b: int) -> dict[str, np.ndarray]:
        """This process's rows of evaluation batch `b`, packed like a training batch."""
        T = self.seq_len
        if self.rows is None:
            first = self.process_index * self.local_batch_size
            rows = np.stack(
                [
                    np.random.default_rng([self.seed, _SYNTHETIC_STREAM + b, g]).integers(
                        0, self.tokenizer.vocab_size, T + 1, dtype=np.int32
                    )
                    for g in range(first, first + self.local_batch_size)
                ]
            )
            return pack_rows(rows, -1)  # random tokens: no document boundaries, every target counts
        if self.read is not None:
            return self.read(self.global_rows(b))
        return read_rows(self.tokens, self.flags, self.global_rows(b), T, self.tokenizer.eos_id)

    def batches(self) -> list[dict[str, np.ndarray]]:
        """Every evaluation batch of this process (read once, then kept: the same rows at every evaluation)."""
        if self._cache is None:
            self._cache = [self.batch(b) for b in range(self.n_batches)]
        return self._cache


def make_eval_batches(
    train_loader, eval_dataset: str | None, n_batches: int | None, *, cache_dir=None, text_field: str | None = None
) -> EvalBatches:
    """The evaluation batches of a run: the training loader's held-out rows (it was made with
    `eval_split`), or `eval_dataset` (any `--dataset` spec) packed with the same tokenizer and seq_len."""
    L = train_loader
    text_field = str(text_field or getattr(L, "text_field", "text"))  # by default read as the training data is
    cache_dir = cache_dir if cache_dir is not None else getattr(L, "cache_dir", None)
    common = dict(
        tokenizer=L.tokenizer,
        seq_len=L.seq_len,
        global_batch_size=L.global_batch_size,
        n_batches=n_batches,
        process_index=L.process_index,
        process_count=L.process_count,
        seed=L.seed,
    )
    if eval_dataset is None:
        if L.synthetic:
            return EvalBatches(None, None, **common)
        if getattr(L, "sources", None) is not None:  # a mixture: each source's held-out rows in turn
            return EvalBatches(None, L.held_out, source=f"--eval_split={L.eval_split}", read=L.read_held, **common)
        return EvalBatches(
            L.tokens, L.held_out, source=f"--eval_split={L.eval_split}", flags=getattr(L, "flags", None), **common
        )
    if is_synthetic(eval_dataset):
        return EvalBatches(None, None, **common)
    flags: Any = None
    tokens: Any = None
    if getattr(L, "chat", None) is not None:  # chat training data: the evaluation conversations rendered alike
        chat = tokenize_chat(eval_dataset, L.tokenizer, L.seq_len, L.chat, cache_dir=cache_dir, text_field=text_field)
        tokens, flags = chat.tokens, chat.flags
    else:
        tokens = prepare_tokens(
            eval_dataset,
            L.tokenizer,
            cache_dir=cache_dir,
            text_field=text_field,
            process_index=L.process_index,
            process_count=L.process_count,
        )
    num_rows = max(len(tokens) - 1, 0) // L.seq_len
    rows = Rows(num_rows, Bijection(num_rows, (EVAL_SEED,)))  # a sample spread over the whole dataset
    return EvalBatches(tokens, rows, source=f"--eval_dataset={eval_dataset}", flags=flags, **common)
