"""The token-level work of meshlm's lm-eval model (meshlm/eval/requests.py), without a model."""

import numpy as np
import pytest

from meshlm.eval.requests import (
    continuation_score,
    generation_request,
    length_batches,
    sampling_params,
    scoring_sequence,
    stop_strings,
)
from meshlm.serve.engine.scoring import Scores


def test_scoring_sequence_cuts_the_context_from_the_left_only():
    assert scoring_sequence([1, 2, 3], [4, 5], max_length=10) == ([1, 2, 3, 4, 5], 2)
    # the forward takes max_length tokens: the sequence is one longer (its last token only predicted)
    assert scoring_sequence([1, 2, 3, 4, 5], [6, 7], max_length=4) == ([3, 4, 5, 6, 7], 2)
    with pytest.raises(ValueError, match="does not fit"):
        scoring_sequence([1], [2, 3, 4], max_length=2)


def test_continuation_score_sums_the_last_tokens():
    n = 5
    scores = Scores(
        np.arange(n, dtype=np.int32),
        np.array([np.nan, -1, -2, -3, -4], np.float32),
        np.zeros((n, 0), np.int32),
        np.zeros((n, 0), np.float32),
        np.array([False, True, False, True, True]),
        np.zeros(0, np.int32),
        np.zeros(0, np.float32),
    )
    assert continuation_score(scores, 2) == (-7.0, True)
    assert continuation_score(scores, 3) == (-9.0, False)
    assert continuation_score(scores, 0) == (0.0, True)


def test_length_batches_go_longest_first_and_cover_everything_once():
    seqs = [[1] * n for n in (3, 9, 1, 7, 5)]
    batches = length_batches(seqs, 2)
    assert batches == [[1, 3], [4, 0], [2]]


def test_generation_request_leaves_room_for_the_new_tokens():
    req = generation_request(
        list(range(100)),
        {"until": ["\n", "", "\n"], "max_gen_toks": 8},
        context=64,
        longest_prompt=64,
        default_max_tokens=256,
        seed=1,
        fallback_token=0,
    )
    assert req.max_tokens == 8 and req.prompt_ids == list(range(44, 100)) and req.stop == ("\n",)
    assert req.sampling.temperature == 0 and req.sampling.seed is None  # greedy unless the task samples
    req = generation_request([], {}, context=64, longest_prompt=32, default_max_tokens=256, seed=1, fallback_token=7)
    assert req.prompt_ids == [7] and req.max_tokens == 63
    req = generation_request(
        list(range(50)), {}, context=64, longest_prompt=32, default_max_tokens=16, seed=1, fallback_token=0
    )
    assert len(req.prompt_ids) == 32 and req.max_tokens == 16


def test_task_sampling_settings():
    assert sampling_params({"do_sample": True}, seed=3).temperature == 1.0
    assert sampling_params({"do_sample": True, "temperature": 0.5, "top_p": 0.9}, seed=3).top_p == 0.9
    assert sampling_params({"do_sample": False, "temperature": 0.7}, seed=3).temperature == 0
    assert sampling_params({"temperature": 0.7}, seed=3).seed == 3
    assert stop_strings("###") == ("###",) and stop_strings(None) == ()
    with pytest.raises(ValueError, match="until"):
        stop_strings([1])
