"""Packing and per-process loading: token ids in, one process's share of each global batch out.

Every document is tokenized, closed by the end-of-text id and concatenated into one stream of
memory-mapped shards (`meshlm.data.prepare`, the processes sharing the work); row r is the `seq_len + 1` tokens from `r * seq_len`. A batch holds
`inputs`, `targets`, `segment_ids`, `positions` and `loss_mask`, each `[rows, seq_len]`. Step s
reads rows of the epoch's permutation seeded by (seed, epoch); process p of P takes its slice of the
global batch, and `batch(step)` is a pure function of the step, so resuming is exact. The order is a
keyed bijection (`meshlm.data.shuffle`): no permutation of the corpus is stored, and a step reads
only its rows from the memory map. `next(loader)` takes batches read ahead on a thread
(`meshlm.data.prefetch`). Chat data
(`meshlm.data.chat`) is read the same way with a flags stream; `held_out_rows` sets rows aside for
evaluation (`eval_split`). docs/data.md, "Packing and loading", has the layout in full.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from typing import Any

import numpy as np
from rich.console import Console

from meshlm.data.chat import LOSS_ON, ChatOptions, is_chat_dataset, pack_chat_rows, tokenize_chat
from meshlm.data.corpus import atomic_write, cache_root, is_synthetic, open_corpus
from meshlm.data.prefetch import DEFAULT_DEPTH, ReadsAhead
from meshlm.data.prepare import prepare_tokens
from meshlm.data.shuffle import EVAL_SEED, Bijection, RowOrder, Rows
from meshlm.data.token_cache import DamagedCache, TokenStream, open_token_cache
from meshlm.errors import UsageError

_FORMAT = "tokens-v1"  # bump to invalidate cached token files when packing changes
_ENCODE_CHUNK = 256  # documents per parallel encode call
ROW_ORDER = "keyed-v1"  # the row order's version in a data state (meshlm.data.shuffle); older states have none


def pack_rows(rows: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Turn `[n, seq_len + 1]` token rows into a batch dict (see the module docstring)."""
    rows = np.asarray(rows, dtype=np.int32)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    ends = inputs == eos_id  # the target after an end-of-text token starts the next document
    starts = np.zeros_like(ends)
    starts[:, 0] = True
    starts[:, 1:] = ends[:, :-1]
    index = np.arange(inputs.shape[1], dtype=np.int32)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {
        "inputs": np.ascontiguousarray(inputs),
        "targets": np.ascontiguousarray(targets),
        "positions": (index - last_start).astype(np.int32),
        "segment_ids": np.cumsum(starts, axis=1, dtype=np.int32),
        "loss_mask": (~ends).astype(np.float32),
    }


def read_rows(tokens, flags, row_ids, seq_len: int, eos_id: int) -> dict[str, np.ndarray]:
    """The batch of rows `row_ids` of a packed stream (row r: `seq_len + 1` tokens from `r * seq_len`),
    plain text (`flags` None) or chat data with its flags stream."""
    T = seq_len
    if isinstance(tokens, TokenStream) or hasattr(tokens, "ensure_intact"):
        tokens.ensure_intact()  # a file truncated under its memory map would kill the process (SIGBUS)
    rows = np.stack([tokens[r * T : r * T + T + 1] for r in row_ids])
    if flags is None:
        return pack_rows(rows, eos_id)
    return pack_chat_rows(rows, np.stack([flags[r * T : r * T + T + 1] for r in row_ids]))


def chat_options(
    spec: str,
    text_field: str = "text",
    chat_template: str | None = None,
    loss_on: str | None = None,
    long_conversations: str | None = None,
) -> ChatOptions | None:
    """The chat options for `spec` when it is chat data, else None; the chat flags given for plain text are
    one error naming the fix."""
    if is_synthetic(spec) or not is_chat_dataset(spec, text_field):
        given = [
            f"--{n}"
            for n, v in (
                ("chat_template", chat_template),
                ("long_conversations", long_conversations),
                ("loss_on", None if loss_on == "all" else loss_on),
            )
            if v is not None
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} apply to chat data (JSONL lines with a \"messages\" list), and "
                f"{spec!r} is plain text; leave {'them' if len(given) > 1 else 'it'} out"
            )
        return None
    return ChatOptions(chat_template, loss_on or LOSS_ON[0], long_conversations or "truncate")


def held_out_rows(num_rows: int, fraction: float) -> np.ndarray:
    """The `ceil(fraction * num_rows)` row ids held out for evaluation, in evaluation order: a fixed
    random sample that depends on the row count and the fraction alone."""
    return Bijection(num_rows, (EVAL_SEED,))(np.arange(held_out_count(num_rows, fraction)))


def held_out_count(num_rows: int, fraction: float) -> int:
    """How many of `num_rows` rows `held_out_rows` sets aside (at least one training row stays)."""
    if not 0.0 < fraction < 1.0:
        raise UsageError(f"--eval_split={fraction} must be a fraction strictly between 0 and 1, e.g. 0.01")
    return min(num_rows - 1, math.ceil(fraction * num_rows)) if num_rows > 1 else 0


def tokenize_corpus(
    spec: str,
    tokenizer,
    *,
    cache_dir=None,
    text_field: str = "text",
    console: Console | None = None,
) -> np.ndarray:
    """The corpus as one stream of token ids, each document followed by `tokenizer.eos_id`.
    Cached on disk (memory-mapped when read back) keyed by corpus and tokenizer fingerprints; a cache file
    that fails its checks (`meshlm.data.token_cache`: truncated, not a .npy stream, ids beyond the
    vocabulary) is rebuilt, with one line saying why."""
    corpus = open_corpus(spec, text_field)
    key = f"{_FORMAT}|{corpus.spec}|{corpus.fingerprint}|{tokenizer.fingerprint}"
    slug = re.sub(r"[^A-Za-z0-9]+", "_", corpus.spec).strip("_")[-40:] or "corpus"
    path = cache_root(cache_dir) / "tokens" / f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npy"
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    console = console or Console(stderr=True)
    if path.is_file():
        try:
            return open_token_cache(path, dtype, tokenizer.vocab_size)
        except DamagedCache as e:
            console.print(
                f"[meshlm] the token cache {path} {e}: tokenizing {corpus.spec} again",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces, n_docs, n_tokens = [], 0, 0
    with console.status(f"Tokenizing {corpus.spec}...") as status:
        for chunk in _chunks(corpus.documents(), _ENCODE_CHUNK):
            for ids in _encode_documents(tokenizer, chunk):
                pieces += [np.asarray(ids, dtype=dtype), eos]
                n_tokens += len(ids) + 1
            n_docs += len(chunk)
            status.update(f"Tokenizing {corpus.spec}: {n_docs} documents, {n_tokens / 1e6:.1f}M tokens")
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)

    def write(tmp):
        with open(tmp, "wb") as f:
            np.save(f, tokens)

    atomic_write(path, write)
    console.print(
        f"[meshlm] tokenized {corpus.spec}: {n_docs} documents, {n_tokens} tokens -> {path}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return tokens


class DataLoader(ReadsAhead):
    """This process's share of every global batch, forever, deterministic given the seed.

    Iterate it (`next(loader)` is the batch at `loader.step`, then the step advances; with `prefetch`
    > 0 the next batches are read on a thread meanwhile), or ask for any step with `batch(step)`.
    `state()` / `restore(state)` save and set the position; `close()` stops the reading ahead.
    """

    def __init__(
        self,
        spec: str,
        tokenizer,
        seq_len: int,
        global_batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        *,
        start_step: int = 0,
        cache_dir: str | os.PathLike | None = None,
        text_field: str = "text",
        eval_split: float | None = None,
        chat_template: str | None = None,
        loss_on: str | None = None,
        long_conversations: str | None = None,
        prefetch: int = DEFAULT_DEPTH,
    ):
        if seq_len < 1 or global_batch_size < 1:
            raise UsageError(f"seq_len ({seq_len}) and global batch size ({global_batch_size}) must be >= 1")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise UsageError(f"process_index {process_index} is not in [0, process_count={process_count})")
        if global_batch_size % process_count:
            raise UsageError(
                f"global batch size {global_batch_size} is not divisible by the {process_count} "
                f"processes; use a multiple of {process_count}"
            )
        self.spec, self.tokenizer, self.seed, self.shuffle = spec, tokenizer, seed, shuffle
        self.seq_len, self.global_batch_size = seq_len, global_batch_size
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = global_batch_size // process_count
        self.step = int(start_step)
        self.synthetic = is_synthetic(spec)
        self.eval_split = eval_split or None
        self.held_out: Rows | None = None  # None: every row trains (and synthetic data has no rows)
        self.order: RowOrder | None = None
        self.prefetch = int(prefetch)
        self.tokens: Any = None  # the packed stream: prepared shards, or a chat cache's tokens
        self.text_field, self.cache_dir = text_field, cache_dir
        self.chat = chat_options(spec, text_field, chat_template, loss_on, long_conversations)
        self.flags = self.chat_data = None  # chat data only: which targets count, where conversations start
        if self.synthetic:
            self.tokens, self.num_rows = None, None
            self.steps_per_epoch: int | None = None
            return
        if self.chat is not None:
            self.chat_data = tokenize_chat(
                spec, tokenizer, seq_len, self.chat, cache_dir=cache_dir, text_field=text_field
            )
            self.tokens, self.flags = self.chat_data.tokens, self.chat_data.flags
        else:
            self.tokens = prepare_tokens(  # memory-mapped shards; the processes share the tokenizing
                spec,
                tokenizer,
                cache_dir=cache_dir,
                text_field=text_field,
                process_index=process_index,
                process_count=process_count,
            )
        self.num_rows = max(len(self.tokens) - 1, 0) // seq_len
        n_held = held_out_count(self.num_rows, self.eval_split) if self.eval_split else 0
        self.order = RowOrder(self.num_rows, n_held, seed, shuffle)
        n_train, held_out = self.order.n_train, None
        if self.eval_split:
            self.held_out = held_out = Rows(n_held, self.order.held)
        if n_train < global_batch_size:
            held = f" ({len(held_out)} held out by --eval_split={self.eval_split})" if held_out is not None else ""
            raise UsageError(
                f"dataset {spec!r} has {len(self.tokens)} tokens: {n_train} training rows of seq_len "
                f"{seq_len} + 1{held}, fewer than the global batch of {global_batch_size}; use a smaller "
                f"batch or seq_len, or a bigger dataset"
            )
        self.steps_per_epoch = n_train // global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (always 0 for synthetic data)."""
        return self.step // self.steps_per_epoch if self.steps_per_epoch else 0

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`: a dict of `[local_batch, seq_len]` arrays."""
        first = self.process_index * self.local_batch_size
        global_rows = np.arange(first, first + self.local_batch_size)
        if self.synthetic or not self.steps_per_epoch:
            return self._synthetic_batch(step, global_rows)
        return self.read(self.row_ids(step, global_rows))

    def row_ids(self, step: int, global_rows: np.ndarray) -> np.ndarray:
        """The stream's row ids at positions `global_rows` of global batch `step` (an epoch is
        `steps_per_epoch` whole batches; the rows left over are read in later epochs' orders)."""
        assert self.order is not None and self.steps_per_epoch
        epoch, k = divmod(step, self.steps_per_epoch)
        return self.order.train(epoch, k * self.global_batch_size + np.asarray(global_rows))

    def rows_in_order(self, ordinal) -> np.ndarray:
        """The row ids of training ordinals (the k-th row this source gives, over its epochs of every
        training row: a mixture's source reads its rows this way)."""
        assert self.order is not None
        epoch, k = np.divmod(np.asarray(ordinal, dtype=np.int64), self.order.n_train)
        return self.order.train(epoch, k)

    def read(self, row_ids) -> dict[str, np.ndarray]:
        """The batch of the stream's rows `row_ids`, read from the memory map."""
        return read_rows(self.tokens, self.flags, row_ids, self.seq_len, self.tokenizer.eos_id)

    def _synthetic_batch(self, step: int, global_rows: np.ndarray) -> dict[str, np.ndarray]:
        """Uniform random tokens; each row seeded by (seed, step, global row) alone."""
        T, V = self.seq_len, self.tokenizer.vocab_size
        rows = np.stack(
            [
                np.random.default_rng([self.seed, step, int(g)]).integers(0, V, T + 1, dtype=np.int32)
                for g in global_rows
            ]
        )
        shape = (len(global_rows), T)
        return {
            "inputs": rows[:, :-1].copy(),
            "targets": rows[:, 1:].copy(),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), shape).copy(),
            "segment_ids": np.ones(shape, np.int32),
            "loss_mask": np.ones(shape, np.float32),
        }

    def log_fields(self) -> dict[str, float]:
        """Extra per-step metrics (a mixture's tokens per source); none for one dataset."""
        return {}

    def state(self) -> dict[str, int | float | str | None]:
        """The data position, to store in a checkpoint: the step of the next batch, and the
        epoch, seed, row count and held-out row count for checking."""
        state: dict[str, int | float | str | None] = {
            "step": self.step,
            "epoch": self.epoch,
            "seed": self.seed,
            "rows": self.num_rows or 0,
            "order": ROW_ORDER,
        }
        if self.held_out is not None:
            state.update(held_out=len(self.held_out), eval_split=self.eval_split)
        return state

    def restore(self, state: dict) -> None:
        """Continue from a `state()`: the next batch is the one a fresh loader gives at its step."""
        if int(state.get("seed", self.seed)) != self.seed:
            raise UsageError(
                f"the checkpoint's data seed is {state['seed']} but this run's is {self.seed}; "
                f"resume with seed {state['seed']}"
            )
        if int(state.get("rows", self.num_rows or 0)) != (self.num_rows or 0):
            raise UsageError(
                f"the checkpoint was trained on {state['rows']} rows of data but {self.spec!r} "
                f"gives {self.num_rows}; resume with the same dataset, tokenizer and seq_len"
            )
        held, split = int(state.get("held_out", 0)), state.get("eval_split")
        if held != (0 if self.held_out is None else len(self.held_out)):
            was = f"with --eval_split={split} ({held} rows held out)" if held else "without --eval_split"
            now = f"--eval_split={self.eval_split}" if self.eval_split else "no --eval_split"
            raise UsageError(
                f"the checkpoint was trained {was} but this run has {now}; resume {was.split(' (')[0]} "
                f"(the training rows must not change under a run), or use --eval_dataset"
            )
        if state.get("order") != ROW_ORDER and self.num_rows and self.process_index == 0:
            Console(stderr=True).print(
                f"[meshlm] the checkpoint's data position was saved with an earlier order of rows; from step "
                f"{state['step']} on, rows follow this version's order (the same rows, shuffled differently)",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        self.close()
        self.step = int(state["step"])

    def __repr__(self) -> str:
        return (
            f"DataLoader({self.spec!r}, seq_len={self.seq_len}, batch={self.local_batch_size}/"
            f"{self.global_batch_size}, process={self.process_index}/{self.process_count}, "
            f"rows={self.num_rows}, step={self.step})"
        )


def make_loader(
    dataset: str,
    tokenizer,
    seq_len: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    seed: int = 0,
    *,
    shuffle: bool = True,
    start_step: int = 0,
    cache_dir: str | os.PathLike | None = None,
    text_field: str = "text",
    eval_split: float | None = None,
    chat_template: str | None = None,
    loss_on: str | None = None,
    long_conversations: str | None = None,
    prefetch: int = DEFAULT_DEPTH,
) -> DataLoader:
    """A `DataLoader` for a `--dataset` spec (`stdlib`, `synthetic`, a path or glob, `hf:NAME`);
    with `eval_split`, that share of the rows is held out of training (`meshlm.data.heldout`). Chat
    data (`meshlm.data.chat`) is found by its `messages` and rendered with the chat options."""
    return DataLoader(
        dataset,
        tokenizer,
        seq_len,
        global_batch_size,
        process_index,
        process_count,
        seed,
        shuffle,
        start_step=start_step,
        cache_dir=cache_dir,
        text_field=text_field,
        eval_split=eval_split,
        chat_template=chat_template,
        loss_on=loss_on,
        long_conversations=long_conversations,
        prefetch=prefetch,
    )


def _encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of documents; with a `Tokenizer`, special-token text such as "<|endoftext|>"
    inside a document stays text, so eos ids mark only real document ends."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts, special_as_text=True)
    return [tokenizer.encode(t) for t in texts]  # any object with encode(str), eos_id, vocab_size


def _chunks(items, size: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
