"""Chat fine-tuning data: conversations rendered with a chat template, loss on the assistant's tokens.

A chat dataset is `.jsonl` whose lines hold a `messages` list of {"role", "content"} objects. Each
conversation is rendered through the template serving uses (`meshlm.data.chat_template`) and
encoded as serving encodes a prompt; with `--loss_on=assistant` (the default) a token counts when it
starts inside an assistant reply (its text and end-of-turn marker), `--loss_on=all` counts every
token. Conversations are packed whole into blocks of `seq_len` tokens (a longer one cut or dropped,
`--long_conversations`), with a flags stream (`TARGET`, `START`) beside the tokens from which
`pack_chat_rows` numbers the segments.
docs/data.md, "Chat data", has the rendering and packing rules in full.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np

from meshlm.data.chat_template import BUILTIN, DEFAULT_TEMPLATE, ChatTemplate, ChatTemplateError, resolve_chat_template
from meshlm.data.corpus import FileCorpus, atomic_write, cache_root, is_synthetic, open_corpus
from meshlm.errors import UsageError

LOSS_ON = ("assistant", "all")
LONG_CONVERSATIONS = ("truncate", "drop")
TARGET, START = 1, 2  # bits of the flags stream
_FORMAT = "chat-v2"  # bump to invalidate cached chat files when rendering or packing changes


@dataclasses.dataclass(frozen=True)
class ChatOptions:
    """How chat data is rendered and packed (the `--chat_template`, `--loss_on`, `--long_conversations` flags)."""

    chat_template: str | None = None
    loss_on: str = "assistant"
    long_conversations: str = "truncate"


@dataclasses.dataclass
class ChatData:
    """A packed chat dataset: token and flag streams, the template used, and what packing did."""

    tokens: np.ndarray
    flags: np.ndarray
    template: ChatTemplate
    origin: str
    stats: dict

    def save_template(self, tokenizer_dir: str | Path) -> Path | None:
        """Write the template into the run's tokenizer_config.json (`chat_template`), which travels with the
        tokenizer to `meshlm serve`, convert and export: the model is then prompted as it was trained. The
        plain template is serving's default: nothing to write."""
        if self.template.source == DEFAULT_TEMPLATE:
            return None
        path = Path(tokenizer_dir) / "tokenizer_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            config = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**config, "chat_template": self.template.source}, indent=2) + "\n")
        return path

    def describe(self, seq_len: int, options: ChatOptions) -> str:
        """One line for the run's log: conversations, rows, template, loss share, and the long ones."""
        s = self.stats
        share = s["counted"] / max(s["targets"], 1)
        long = s["truncated"] + s["dropped"]
        line = (
            f"chat data: {s['conversations']} conversations in {s['blocks']} rows of {seq_len} tokens, template "
            f"{self.origin}; loss on {options.loss_on} tokens ({share:.0%} of targets)"
        )
        if long:
            done = "truncated" if options.long_conversations == "truncate" else "dropped"
            line += f"; {long} longer than --seq_len={seq_len} {done} (--long_conversations)"
        return line


def is_chat_dataset(spec: str, text_field: str = "text") -> bool:
    """True when `spec` names local .jsonl data whose first record has a `messages` list and no text field."""
    spec = spec.strip()
    if is_synthetic(spec) or spec.lower() == "stdlib" or spec.startswith("hf:"):
        return False
    corpus = cast(FileCorpus, open_corpus(spec, text_field))  # local data (hf: returned above)
    first = next((p for p in corpus.files if p.suffix == ".jsonl"), None)
    if first is None:
        return False
    try:
        with first.open("rb") as f:
            line = next((raw for raw in f if raw.strip()), b"")
        record = json.loads(line.decode("utf-8")) if line else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the text reader names the problem
    return isinstance(record, dict) and isinstance(record.get("messages"), list) and text_field not in record


def read_conversations(corpus: FileCorpus) -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) for every conversation of the corpus's .jsonl files, checked."""
    for path in corpus.files:
        if path.suffix != ".jsonl":
            raise UsageError(f"{path}: chat data must be .jsonl lines with a \"messages\" list; leave other files out")
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    where = f"{path}:{lineno}"
                    yield where, _messages(where, raw)


def _messages(where: str, raw: bytes) -> list[dict]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{where}: not a valid UTF-8 JSON line ({e}); fix or remove it") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: no \"messages\" list; every line of chat data needs one")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f"{where}: message {i} needs a string \"role\" and a string \"content\"; fix it")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_conversation(
    template: ChatTemplate, tokenizer, messages: list[dict], loss_on: str = "assistant", where: str = "conversation"
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation, then its end-of-text id, and per token 1 when it counts
    in the loss as a target (see the module docstring), else 0. A reply counts from the end of the
    generation prompt through its end-of-turn marker (`ChatTemplate.reply_length`)."""
    try:
        full = template.render(messages, add_generation_prompt=False)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = template.render(messages[:k], add_generation_prompt=True)
            through = template.render(messages[: k + 1], add_generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise UsageError(
                    f"{where}: the chat template renders turns before reply {k} differently once "
                    f"later turns follow, so training would not match serving; pass "
                    f"--chat_template={'|'.join(BUILTIN)} (or a Jinja file)"
                )
            spans.append((len(before), len(before) + template.reply_length(through[len(before) :])))
    except ChatTemplateError as e:
        raise UsageError(f"{where}: {e}; fix the conversation or pass another --chat_template") from None
    ids, offsets = tokenizer.encode_offsets(full)
    if loss_on == "all":
        weights = [1] * len(ids)
    else:
        weights = [int(any(a <= start < b for a, b in spans)) for start, _ in offsets]
    if not ids or ids[-1] != tokenizer.eos_id:
        ids = [*ids, tokenizer.eos_id]  # the last reply's end when the template writes no marker of its own
        ends_on_reply = bool(spans) and messages[-1]["role"] == "assistant" and spans[-1][1] == len(full)
        weights.append(int(loss_on == "all" or ends_on_reply))
    weights[0] = 0  # the first token is never a target within its conversation
    return list(ids), weights


def pack_conversations(encoded, seq_len: int, eos_id: int, long_conversations: str = "truncate"):
    """(tokens, flags, stats): the conversations laid into blocks of `seq_len` tokens (module docstring)."""
    tokens, flags, fill = [], [], 0
    stats = {"conversations": 0, "truncated": 0, "dropped": 0, "blocks": 0, "targets": 0, "counted": 0}

    def pad(n):
        tokens.append(np.full(n, eos_id, np.int64))
        flags.append(np.r_[START, np.zeros(n - 1, np.uint8)].astype(np.uint8))

    for ids, weights in encoded:
        stats["conversations"] += 1
        if len(ids) > seq_len:
            if long_conversations == "drop":
                stats["dropped"] += 1
                continue
            stats["truncated"] += 1
            ids, weights = ids[:seq_len], weights[:seq_len]
        if fill + len(ids) > seq_len:
            pad(seq_len - fill)
            fill = 0
        f = np.asarray(weights, np.uint8) * TARGET
        f[0] |= START
        tokens.append(np.asarray(ids, np.int64))
        flags.append(f)
        fill = (fill + len(ids)) % seq_len
        stats["targets"] += len(ids) - 1
        stats["counted"] += int(np.sum(weights))
    if fill:
        pad(seq_len - fill)
    pad(1)  # the last row's last target
    token_array, flag_array = np.concatenate(tokens), np.concatenate(flags)
    stats["blocks"] = (len(token_array) - 1) // seq_len
    return token_array, flag_array, stats


def pack_chat_rows(rows: np.ndarray, flags: np.ndarray) -> dict[str, np.ndarray]:
    """`[n, seq_len + 1]` token rows and their flags to a batch dict like `meshlm.data.loader.pack_rows`'s:
    segments begin at START flags (and at the row start), only TARGET-flagged targets count."""
    rows, flags = np.asarray(rows, np.int32), np.asarray(flags, np.uint8)
    starts = (flags[:, :-1] & START) != 0
    starts[:, 0] = True
    index = np.arange(starts.shape[1], dtype=np.int32)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    counted = ((flags[:, 1:] & TARGET) != 0) & ((flags[:, 1:] & START) == 0)
    return {
        "inputs": np.ascontiguousarray(rows[:, :-1]),
        "targets": np.ascontiguousarray(rows[:, 1:]),
        "positions": (index - last_start).astype(np.int32),
        "segment_ids": np.cumsum(starts, axis=1, dtype=np.int32),
        "loss_mask": counted.astype(np.float32),
    }


def tokenize_chat(
    spec: str,
    tokenizer,
    seq_len: int,
    options: ChatOptions = ChatOptions(),
    *,
    cache_dir=None,
    text_field: str = "text",
) -> ChatData:
    """Render, encode and pack a chat dataset (cached on disk, keyed by the data, tokenizer, template,
    options and seq_len)."""
    if not hasattr(tokenizer, "encode_offsets"):
        raise UsageError("chat data needs a real tokenizer; pass --tokenizer=PATH or let meshlm train one")
    corpus = open_corpus(spec, text_field)
    template, origin = resolve_chat_template(options.chat_template, tokenizer)
    key = "|".join(
        map(
            str,
            (
                _FORMAT,
                corpus.spec,
                corpus.fingerprint,
                tokenizer.fingerprint,
                template.source,
                template.bos_token,
                template.eos_token,
                options.loss_on,
                options.long_conversations,
                seq_len,
            ),
        )
    )
    slug = re.sub(r"[^A-Za-z0-9]+", "_", corpus.spec).strip("_")[-40:] or "chat"
    path = cache_root(cache_dir) / "chat" / f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    if path.is_file():
        with np.load(path) as f:
            return ChatData(f["tokens"], f["flags"], template, origin, json.loads(str(f["stats"])))
    encoded = (
        encode_conversation(template, tokenizer, messages, options.loss_on, where)
        for where, messages in read_conversations(cast(FileCorpus, corpus))
    )
    tokens, flags, stats = pack_conversations(encoded, seq_len, tokenizer.eos_id, options.long_conversations)
    tokens = tokens.astype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)

    def write(tmp: Path):
        with open(tmp, "wb") as f:
            np.savez(f, tokens=tokens, flags=flags, stats=json.dumps(stats))

    atomic_write(path, write)
    return ChatData(tokens, flags, template, origin, stats)


__all__ = [
    "LOSS_ON",
    "LONG_CONVERSATIONS",
    "ChatData",
    "ChatOptions",
    "encode_conversation",
    "is_chat_dataset",
    "pack_chat_rows",
    "pack_conversations",
    "read_conversations",
    "tokenize_chat",
]
