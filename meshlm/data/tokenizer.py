"""Tokenizers: a byte-level BPE trained on the corpus and cached, or any `tokenizer.json`.

`load_tokenizer(None, "stdlib", 32000)` trains (once) a byte-level BPE with 32000 entries on a
sample of `train_chars` characters spread over the corpus (`sample_documents`) and caches it under
`<cache>/tokenizers/<spec>-<vocab>-<hash>/tokenizer.json`; the hash covers the spec, the vocab size,
the training cap and the corpus fingerprint. `load_tokenizer("path/to/dir", ...)` loads a Hugging
Face `tokenizer.json` instead. The `synthetic` dataset gets a trivial `SyntheticTokenizer`.

Every tokenizer has an end-of-text token (`eos_id`) that separates packed documents, and a
`vocab_size` that the caller compares with the model's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import tokenizers
from rich.console import Console
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshlm.data.corpus import Corpus, atomic_write, cache_root, is_synthetic, open_corpus
from meshlm.errors import UsageError

EOS_TOKEN = "<|endoftext|>"
# End-of-text tokens of common tokenizer families, tried in order when loading a tokenizer.json.
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
DEFAULT_TRAIN_CHARS = 8_000_000  # the characters the BPE trainer reads: enough for a 32k vocabulary
_SAMPLE_UNIT_BYTES = 4 << 20  # the sample is drawn from units of the corpus this big
_SAMPLE_SPOTS = 64  # at most this many evenly spaced units give the sample its documents
_MIN_VOCAB = 257  # 256 byte tokens + <|endoftext|>
_FORMAT = "bytebpe-v2"  # bump to invalidate cached tokenizers when training changes


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with the few things meshlm needs."""

    def __init__(
        self, tok: tokenizers.Tokenizer, path: Path | None = None, eos_token: str = EOS_TOKEN, bos_token: str = ""
    ):
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise UsageError(f"tokenizer has no {eos_token!r} token; use one with an end-of-text token")
        self._tok = tok
        self._as_text: tokenizers.Tokenizer | None = None  # a copy that encodes special tokens' text as plain text
        self.path = path  # the tokenizer.json this was loaded from or last saved to
        self.eos_token = eos_token
        self.eos_id = eos_id
        self.bos_token = bos_token  # what a chat template's {{ bos_token }} writes ("" when the tokenizer has none)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included: the model's vocab must be at least this."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        """A hash of the full tokenizer definition: keys the token-id cache."""
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]

    def encode(self, text: str, add_special_tokens: bool = False, special_as_text: bool = False) -> list[int]:
        """Token ids of `text`. `add_special_tokens` applies the tokenizer's template (e.g. BOS).
        Special tokens written in the text (say "<|endoftext|>") become their ids, unless
        `special_as_text`, which encodes them as plain text: training data uses that, so that
        the eos id appears in packed data only where a document really ends."""
        tok = self._plain_text_tokenizer() if special_as_text else self._tok
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], special_as_text: bool = False) -> list[list[int]]:
        """`encode` for many texts at once, in parallel."""
        tok = self._plain_text_tokenizer() if special_as_text else self._tok
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` (special tokens written in the text become their ids, as serving encodes a
        prompt) and each token's (start, end) character span in `text`."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def _plain_text_tokenizer(self) -> tokenizers.Tokenizer:
        if self._as_text is None:
            as_text = tokenizers.Tokenizer.from_str(self._tok.to_str())
            as_text.encode_special_tokens = True
            self._as_text = as_text
        return self._as_text

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of token ids (a list or a 1-D array)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `tokenizer.json` (and a `tokenizer_config.json` naming the eos token, which
        Hugging Face `transformers` reads) into `directory`; return the tokenizer.json path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "tokenizer.json"
        self._tok.save(str(path))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token}
        if self.bos_token:
            config["bos_token"] = self.bos_token
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        self.path = path
        return path

    @classmethod
    def from_file(cls, spec: str | os.PathLike) -> Tokenizer:
        """Load a `tokenizer.json`, or the one inside a directory."""
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise UsageError(
                f"tokenizer {str(spec)!r} not found: pass a tokenizer.json file or a directory holding one"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise UsageError(f"cannot load tokenizer {str(path)!r} ({e}); pass a Hugging Face tokenizer.json") from e
        return cls(tok, path, _find_eos(tok, path.parent), _config_token(tok, path.parent, "bos_token") or "")

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, path={self.path})"


class SyntheticTokenizer:
    """Stand-in for the `synthetic` dataset, whose tokens are random ids: bytes map to ids 0..255
    (modulo the vocab) and the last id is end-of-text. Nothing to train, load or save."""

    path = None

    def __init__(self, vocab_size: int):
        if vocab_size < 2:
            raise UsageError(f"vocab_size must be at least 2, got {vocab_size}; raise it")
        self.vocab_size = vocab_size
        self.eos_id = vocab_size - 1
        self.fingerprint = f"synthetic-{vocab_size}"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.eos_id for b in text.encode("utf-8")] if self.eos_id else []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def save(self, directory) -> None:
        return None

    def __repr__(self) -> str:
        return f"SyntheticTokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(
    spec: str | None,
    dataset: str,
    vocab_size: int,
    *,
    cache_dir: str | os.PathLike | None = None,
    text_field: str = "text",
    train_chars: int = DEFAULT_TRAIN_CHARS,
) -> Tokenizer | SyntheticTokenizer:
    """The tokenizer for a run: `spec` is a tokenizer.json (or its directory); None trains (or
    takes from the cache) a byte-level BPE of `vocab_size` on `dataset`'s corpus."""
    if spec:
        return Tokenizer.from_file(spec)
    if is_synthetic(dataset):
        return SyntheticTokenizer(vocab_size)
    return train_tokenizer(dataset, vocab_size, cache_dir=cache_dir, text_field=text_field, train_chars=train_chars)


def train_tokenizer(
    dataset: str,
    vocab_size: int,
    *,
    cache_dir: str | os.PathLike | None = None,
    text_field: str = "text",
    train_chars: int = DEFAULT_TRAIN_CHARS,
    console: Console | None = None,
) -> Tokenizer:
    """Train a byte-level BPE on `train_chars` characters sampled over the corpus, or return the
    cached one trained with the same inputs."""
    if vocab_size < _MIN_VOCAB:
        raise UsageError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE (needs >= {_MIN_VOCAB}: "
            f"256 bytes + {EOS_TOKEN}); raise the model's vocab_size"
        )
    corpus = open_corpus(dataset, text_field)
    key = f"{_FORMAT}|{corpus.spec}|{vocab_size}|{train_chars}|{corpus.fingerprint}"
    slug = re.sub(r"[^A-Za-z0-9]+", "_", corpus.spec).strip("_")[-40:] or "corpus"
    path = (
        cache_root(cache_dir)
        / "tokenizers"
        / f"{slug}-{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        / "tokenizer.json"
    )
    if path.is_file():
        return Tokenizer.from_file(path)

    console = console or Console(stderr=True)
    texts = sample_documents(corpus, train_chars)
    n_chars = sum(map(len, texts))
    if not n_chars:
        raise UsageError(f"dataset {dataset!r} holds no text to train a tokenizer on; point at text files")
    start = time.perf_counter()
    what = f"vocab {vocab_size}, {n_chars / 1e6:.1f} MB of {corpus.spec}"
    with console.status(f"Training a byte-level BPE tokenizer ({what})..."):
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
    atomic_write(path, lambda tmp: tok.save(str(tmp)))
    console.print(
        f"[meshlm] trained tokenizer: vocab {tok.get_vocab_size()} on {n_chars / 1e6:.1f} MB "
        f"of {corpus.spec} in {time.perf_counter() - start:.1f} s -> {path}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return Tokenizer(tok, path)


def sample_documents(corpus: Corpus, max_chars: int) -> list[str]:
    """About `max_chars` characters of documents spread over the whole corpus: the leading documents of
    evenly spaced work units (every unit when the corpus is small), each unit's share of the budget
    passed on to the next when it holds less. The same corpus always gives the same sample."""
    units = corpus.units(_SAMPLE_UNIT_BYTES)
    spots = min(len(units), _SAMPLE_SPOTS)
    if sum(u.nbytes for u in units) <= 2 * max_chars:
        spots = len(units)
    picked = sorted({round(i * (len(units) - 1) / max(spots - 1, 1)) for i in range(spots)})
    texts: list[str] = []
    total = 0
    for n, index in enumerate(picked):
        budget = (max_chars - total) // (len(picked) - n)
        taken = _capped(units[index].documents(), budget)
        texts += taken
        total += sum(map(len, taken))
    return texts


def _capped(documents, max_chars: int) -> list[str]:
    """The leading documents up to `max_chars` characters in all (the last one cut to fit)."""
    texts: list[str] = []
    total = 0
    for doc in documents:
        if total >= max_chars:
            break
        texts.append(doc[: max_chars - total])
        total += len(texts[-1])
    return texts


def _config_token(tok: tokenizers.Tokenizer, directory: Path, key: str) -> str | None:
    """`tokenizer_config.json`'s special token `key` (eos_token, bos_token) when the tokenizer has it."""
    try:
        token = json.loads((directory / "tokenizer_config.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and tok.token_to_id(token) is not None else None


def _find_eos(tok: tokenizers.Tokenizer, directory: Path) -> str:
    """The end-of-text token: `tokenizer_config.json`'s eos_token when present, else a known one."""
    eos = _config_token(tok, directory, "eos_token")
    if eos is not None:
        return eos
    for candidate in _EOS_CANDIDATES:
        if tok.token_to_id(candidate) is not None:
            return candidate
    raise UsageError(
        f"tokenizer in {directory} has no end-of-text token (looked for "
        f"{', '.join(_EOS_CANDIDATES)}); add one or name it as eos_token in tokenizer_config.json"
    )
