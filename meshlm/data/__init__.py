"""Training data: corpora (`corpus.py`), tokenizers (`tokenizer.py`), packing and per-process
loading (`loader.py`).

    tok = load_tokenizer(None, "stdlib", vocab_size=32000)   # trains once, then cached
    loader = make_loader("stdlib", tok, seq_len=1024, global_batch_size=64,
                         process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(loader)   # dict of numpy arrays [64 / process_count, 1024]

    loader = make_loader(..., eval_split=0.01)            # 1% of the rows never train ...
    evals = make_eval_batches(loader, None, n_batches=4)  # ... and are evaluated (heldout.py)
    loader = make_loader("mix.toml", tok, ...)             # several datasets by weight (mixture.py)
"""

from meshlm.data.corpus import (
    DEFAULT_DATASET,
    SYNTHETIC,
    Corpus,
    cache_root,
    is_synthetic,
    open_corpus,
)
from meshlm.data.heldout import EvalBatches, make_eval_batches
from meshlm.data.loader import DataLoader, held_out_rows, pack_rows, tokenize_corpus
from meshlm.data.mixture import MixtureLoader, is_mixture, load_tokenizer, make_loader, token_corpora
from meshlm.data.prepare import prepare_tokens
from meshlm.data.tokenizer import (
    EOS_TOKEN,
    SyntheticTokenizer,
    Tokenizer,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_DATASET",
    "EOS_TOKEN",
    "SYNTHETIC",
    "Corpus",
    "DataLoader",
    "EvalBatches",
    "MixtureLoader",
    "SyntheticTokenizer",
    "Tokenizer",
    "cache_root",
    "held_out_rows",
    "is_mixture",
    "is_synthetic",
    "load_tokenizer",
    "make_eval_batches",
    "make_loader",
    "open_corpus",
    "pack_rows",
    "prepare_tokens",
    "token_corpora",
    "tokenize_corpus",
    "train_tokenizer",
]
