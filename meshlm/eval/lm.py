"""meshlm as an lm-evaluation-harness model, registered as `meshlm`: tasks run in this process, on the
mesh the weights are placed on.

    import meshlm.eval.lm                                        # registers "meshlm" with lm-eval
    lm = MeshLM(loaded_model, batch_size=16)                     # a meshlm.serve.loading.LoadedModel
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

`loglikelihood` and `loglikelihood_rolling` requests are scored in batches by the engine's scorer
(`meshlm.serve.engine.scoring`), tokenized as lm-eval's TemplateLM does; `generate_until` queues
every request on a generation engine made on first use from the same weights. docs/eval.md, "The
in-process model", says how each request kind is cut and scored.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import lm_eval.models  # noqa: F401  (lm-eval's own models first: it looks for them only in an empty registry)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from meshlm.eval.requests import continuation_score, generation_request, length_batches, scoring_sequence

log = logging.getLogger("meshlm.eval")

DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256


def _batch_size(value: Any) -> int:
    """lm-eval passes `batch_size` as an int, a numeric string or "auto" (taken as the default here)."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    size = int(value)
    if size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {value!r}")
    return size


@register_model("meshlm")
class MeshLM(TemplateLM):
    """An lm-eval model over a meshlm `LoadedModel` (or a checkpoint that `load_model` reads).

    `context` is the longest sequence scored or generated (prompt + new tokens) [default: the model's,
    at most 2048]; `max_length`, the tokens one forward takes, is `context - 1` unless given (lower).
    `engine_batch` and `prefill_buckets` shape the generation engine [default: batch_size rounded up
    to the data-parallel size, and the engine's own buckets]."""

    def __init__(
        self,
        model: Any = None,
        *,
        checkpoint: str | None = None,
        batch_size: Any = DEFAULT_BATCH_SIZE,
        context: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        engine_batch: int | None = None,
        prefill_buckets: tuple[int, ...] | None = None,
        add_bos_token: bool = False,
        seed: int = 1234,
        mesh_dim: str = "1,1,-1,1",
        dtype: str = "auto",
        step: int | None = None,
        tokenizer: str | None = None,
        **others: Any,
    ):
        super().__init__()
        unknown = sorted(k for k, v in others.items() if k not in ("device", "max_batch_size") and v is not None)
        if unknown:  # lm-eval's own extras (device, max_batch_size) mean nothing on a mesh; anything else is a typo
            log.warning("meshlm model: ignoring unknown argument(s) %s", ", ".join(unknown))
        if model is None:
            if checkpoint is None:
                raise ValueError("give a LoadedModel or checkpoint=PATH")
            from meshlm.serve.loading import load_model

            model, _ = load_model(
                checkpoint, mesh_dim=mesh_dim, dtype=dtype, max_seq_len=context, step=step, tokenizer=tokenizer
            )
        self.model, self.tokenizer = model, model.tokenizer
        self.batch_size = _batch_size(batch_size)
        self.context = int(context or min(model.cfg.max_seq_len, 2048))
        if not 2 <= self.context <= model.cfg.max_seq_len:
            raise ValueError(f"context {self.context} must be in [2, the model's max_seq_len {model.cfg.max_seq_len}]")
        self._max_length = min(int(max_length or self.context - 1), self.context - 1)
        self.max_gen_toks = int(max_gen_toks)
        self.engine_batch, self.prefill_buckets = engine_batch, prefill_buckets
        self.add_bos_token, self.seed = bool(add_bos_token), seed
        self._scorer = None
        self.engine = None

    # ------------------------------------------------------------------------- lm-eval's API

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "path", None) or self.model.name)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer.encode(string, add_special_tokens=special))

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache key or None, context ids, continuation ids) -> (log p, is greedy) each."""
        pairs = [scoring_sequence(ctx, cont, self.max_length) for _, ctx, cont in requests]
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        sequences = [seq for seq, _ in pairs]
        with tqdm(total=len(pairs), desc="Scoring (meshlm)", disable=disable_tqdm) as bar:
            for batch in length_batches(sequences, self.batch_size):
                scores = self.scorer().score([sequences[i] for i in batch])
                for i, s in zip(batch, scores):
                    out[i] = continuation_score(s, pairs[i][1])
                    key = requests[i][0]
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, out[i])
                bar.update(len(batch))
        return cast(list[tuple[float, bool]], out)  # every request scored by now

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for doc, (text,) in enumerate(req.args for req in requests):
            for window in get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                windows.append((None, *make_disjoint_window(window)))
                owner.append(doc)
        totals = [0.0] * len(requests)
        for doc, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[doc] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        engine = self.generation_engine()
        prompts = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            prompts.append(
                generation_request(
                    self.tok_encode(context),
                    gen_kwargs,
                    context=engine.max_seq_len,
                    longest_prompt=engine.buckets[-1],
                    default_max_tokens=self.max_gen_toks,
                    seed=self.seed + i,
                    fallback_token=self.prefix_token_id,
                )
            )
        handles = [engine.submit(p) for p in prompts]  # all queued: the engine runs max_batch at once
        out = []
        try:
            for req, handle in tqdm(list(zip(requests, handles)), desc="Generating (meshlm)", disable=disable_tqdm):
                text, reason = handle.result()
                if reason in ("error", "cancelled"):
                    raise RuntimeError(f"generation {reason} (see the log above)")
                out.append(text)
                self.cache_hook.add_partial("generate_until", req.args, text)
        finally:
            for handle in handles:
                handle.cancel()
        return out

    # ---------------------------------------------------------------------------- meshlm side

    def scorer(self):
        """The scorer over the model's weights, or over the engine's once there is one."""
        if self._scorer is None:
            from meshlm.serve.engine.scoring import Scorer

            self._scorer = Scorer.from_model(self.model, max_len=self.context, max_batch=self.batch_size)
        return self._scorer

    def generation_engine(self):
        """The engine (compiled and started on first use). It takes the weights over, so scoring moves
        onto its copy of them."""
        if self.engine is None:
            from meshlm import sharding
            from meshlm.serve.engine.batching import Engine

            data = sharding.data_parallel_size(self.model.placement.mesh, self.model.placement.strategy)
            slots = self.engine_batch or -(-self.batch_size // data) * data
            self._scorer = None
            log.info("compiling the generation engine: %d slots, context %d", slots, self.context)
            self.engine = Engine(
                self.model, max_batch=slots, max_seq_len=self.context, prefill_buckets=self.prefill_buckets
            ).start()
            self._scorer = self.engine.scorer()
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()


__all__ = ["MeshLM", "DEFAULT_BATCH_SIZE", "DEFAULT_MAX_GEN_TOKS"]
