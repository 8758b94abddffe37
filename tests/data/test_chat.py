"""Chat fine-tuning data: only assistant tokens count, training renders what serving prompts, packing keeps
conversations whole with their segment ids, long conversations are truncated or dropped and counted."""

import json
from pathlib import Path

import numpy as np
import pytest

from meshlm.config import TrainConfig
from meshlm.data import load_tokenizer, make_eval_batches, make_loader
from meshlm.data.chat import (
    START,
    TARGET,
    ChatOptions,
    encode_conversation,
    pack_chat_rows,
    pack_conversations,
    tokenize_chat,
)
from meshlm.data.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,  # what `meshlm serve` renders a chat request with
    resolve_chat_template,
)
from meshlm.errors import UsageError
from tests.support.chat_families import CONVERSATION

SHIPPED = Path(__file__).parents[2] / "examples" / "chat_small.jsonl"
# A template of the tokenizer's own (tokenizer_config.json), with an end-of-turn marker it does not know.
OWN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}\n<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant\n{% endif %}"
)


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE trained on the shipped chat file, with <|im_start|>/<|im_end|> as special tokens."""
    tok = load_tokenizer(None, str(SHIPPED), 600, cache_dir=tmp_path_factory.mktemp("tokcache"))
    tok._tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def chat_file(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return str(path)


def turns(n_words):
    """A user question and an assistant answer of about n_words words."""
    return [{"role": "user", "content": "Say words."}, {"role": "assistant", "content": " ".join(["word"] * n_words)}]


@pytest.mark.parametrize("name,reply_end,closing", [("chatml", "<|im_end|>", ""), ("plain", "\n\n", "<|endoftext|>")])
def test_only_the_assistant_tokens_count_token_by_token(tok, name, reply_end, closing):
    template, _ = resolve_chat_template(name, tok)
    ids, weights = encode_conversation(template, tok, CONVERSATION)
    assert len(ids) == len(weights) and ids[-1] == tok.eos_id
    counted = tok.decode([i for i, w in zip(ids, weights) if w])
    other = tok.decode([i for i, w in zip(ids, weights) if not w])
    lead = "" if name == "chatml" else " "  # the plain template writes "Assistant: reply"
    replies = [lead + m["content"] + reply_end for m in CONVERSATION if m["role"] == "assistant"]
    # the replies through their end-of-turn marker; the end of text closes a reply only where no marker does
    assert counted == "".join(replies) + closing
    full = template.render(CONVERSATION, add_generation_prompt=False)
    assert other + "".join(replies) != full and sorted(other + counted) == sorted(full + "<|endoftext|>")
    for m in CONVERSATION:  # the prompts are never counted
        if m["role"] != "assistant":
            assert m["content"] in other and m["content"] not in counted
    # token by token: a token counts exactly when it lies inside a reply
    spans = []
    for k, m in enumerate(CONVERSATION):
        if m["role"] == "assistant":
            before = template.render(CONVERSATION[:k])
            spans.append((len(before), len(before) + len(lead + m["content"] + reply_end)))
    _, offsets = tok.encode_offsets(full)
    for i, (start, _) in enumerate(offsets):
        assert weights[i] == (i > 0 and any(a <= start < b for a, b in spans)), i
    all_ids, all_weights = encode_conversation(template, tok, CONVERSATION, loss_on="all")
    assert all_ids == ids and all_weights == [0] + [1] * (len(ids) - 1)


def test_a_conversation_ending_on_the_user_leaves_its_end_uncounted(tok):
    template, _ = resolve_chat_template("chatml", tok)
    ids, weights = encode_conversation(template, tok, CONVERSATION[:4])
    assert ids[-1] == tok.eos_id and weights[-1] == 0 and sum(weights) > 0


@pytest.mark.parametrize("source", ["chatml", "plain", "own"])
def test_serving_prompt_equals_the_training_tokens_up_to_each_reply(tok, tmp_path, source):
    if source == "own":  # the tokenizer's own template, from tokenizer_config.json beside tokenizer.json
        from meshlm.data import Tokenizer

        Tokenizer(tok._tok, eos_token=tok.eos_token).save(tmp_path / "tokenizer")  # a copy: the fixture stays as it is
        config = json.loads((tmp_path / "tokenizer" / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer" / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": OWN_TEMPLATE})
        )
        tok = Tokenizer.from_file(tmp_path / "tokenizer")
        template, origin = resolve_chat_template(None, tok)
        assert origin == "the tokenizer's own" and template.source == OWN_TEMPLATE
        served = ChatTemplate.from_source(OWN_TEMPLATE, bos_token="", eos_token=tok.eos_token)
    else:
        template, _ = resolve_chat_template(source, tok)
        served = (
            ChatTemplate() if source == "plain" else ChatTemplate.from_source(CHATML_TEMPLATE, eos_token=tok.eos_token)
        )
    ids, weights = encode_conversation(template, tok, CONVERSATION)
    for k, m in enumerate(CONVERSATION):
        if m["role"] != "assistant":
            continue
        prompt = tok.encode(served.render(CONVERSATION[:k]))  # as meshlm.serve encodes a chat request
        assert ids[: len(prompt)] == prompt, k
        assert weights[len(prompt) - 1] == 0 and weights[len(prompt)] == 1  # the reply's first token counts


def test_packing_keeps_conversations_whole_with_their_segment_ids():
    eos, T = 0, 8
    convs = [
        ([5, 6, 7], [0, 0, 1]),
        ([8, 9, 0], [0, 1, 1]),
        ([3, 4, 5, 6, 0], [0, 0, 1, 1, 1]),
        ([9] * 8, [0] + [1] * 7),
    ]
    tokens, flags, stats = pack_conversations(convs, T, eos)
    assert stats == {"conversations": 4, "truncated": 0, "dropped": 0, "blocks": 3, "targets": 15, "counted": 13}
    # block 0: conv 0 + conv 1 (6 tokens) + 2 pad; block 1: conv 2 + 3 pad; block 2: conv 3; then one closing pad
    np.testing.assert_array_equal(tokens, [5, 6, 7, 8, 9, 0, 0, 0, 3, 4, 5, 6, 0, 0, 0, 0] + [9] * 8 + [0])
    rows = np.stack([tokens[r * T : r * T + T + 1] for r in range(3)])
    b = pack_chat_rows(rows, np.stack([flags[r * T : r * T + T + 1] for r in range(3)]))
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 2, 3, 3], [1] * 5 + [2] * 3, [1] * 8])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2], list(range(8))])
    np.testing.assert_array_equal(b["loss_mask"], [[0, 1, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0], [1] * 7 + [0]])
    # segments come from the flags, not from end-of-text ids: an eos inside a conversation splits nothing
    assert b["inputs"][0, 5] == eos and b["segment_ids"][0, 5] == b["segment_ids"][0, 4]
    assert (flags[[0, 3, 6, 8, 13, 16, 24]] & START).all() and not (flags[[1, 2, 4, 5]] & START).any()
    assert not (flags[[6, 7, 13, 14, 15, 24]] & TARGET).any()  # padding never counts


def test_long_conversations_are_truncated_or_dropped_and_counted():
    convs = [([1] * 3, [0, 1, 1]), ([2] * 12, [0] + [1] * 11), ([3] * 9, [0] + [1] * 8), ([4] * 8, [0] + [1] * 7)]
    tokens, flags, stats = pack_conversations(convs, 8, 0, "truncate")
    assert (stats["truncated"], stats["dropped"], stats["blocks"]) == (2, 0, 4)
    assert list(tokens[8:16]) == [2] * 8 and list(tokens[16:24]) == [3] * 8
    tokens, flags, stats = pack_conversations(convs, 8, 0, "drop")
    assert (stats["truncated"], stats["dropped"], stats["blocks"]) == (0, 2, 2)
    assert 2 not in tokens and 3 not in tokens and list(tokens[8:16]) == [4] * 8


def test_the_loader_reads_chat_rows_and_logs_the_long_ones(tok, tmp_path):
    convs = [CONVERSATION] * 6 + [turns(3)] * 10 + [turns(400)] * 2
    spec = chat_file(tmp_path / "chat.jsonl", convs)
    loader = make_loader(spec, tok, 128, 4, chat_template="chatml")
    assert loader.chat == ChatOptions("chatml", "assistant", "truncate") and loader.flags is not None
    line = loader.chat_data.describe(128, loader.chat)
    assert "18 conversations" in line and "2 longer than --seq_len=128 truncated" in line and "template chatml" in line
    for step in range(loader.steps_per_epoch):
        b = loader.batch(step)
        assert b["loss_mask"].sum() > 0
        starts = np.diff(b["segment_ids"], axis=1) != 0
        np.testing.assert_array_equal(b["positions"][:, 1:][starts], 0)  # each segment starts at position 0
    dropped = make_loader(spec, tok, 128, 4, chat_template="chatml", long_conversations="drop")
    assert "2 longer than --seq_len=128 dropped" in dropped.chat_data.describe(128, dropped.chat)
    assert dropped.num_rows < loader.num_rows
    held = make_loader(spec, tok, 128, 2, chat_template="chatml", eval_split=0.3)
    evals = make_eval_batches(held, None, 1)
    b = evals.batch(0)
    assert held.held_out is not None and b["loss_mask"].sum() > 0 and b["loss_mask"].sum() < b["loss_mask"].size


def test_the_shipped_chat_file_trains_by_default_on_its_replies(tok):
    loader = make_loader(str(SHIPPED), tok, 256, 8)
    assert loader.chat.loss_on == "assistant" and loader.chat_data.stats["conversations"] == 50
    assert "template plain (the tokenizer has no chat template)" in loader.chat_data.describe(256, loader.chat)
    data = tokenize_chat(str(SHIPPED), tok, 256)  # the cached copy reads back the same
    np.testing.assert_array_equal(data.tokens, loader.tokens)


def test_plain_jsonl_under_another_key_and_the_errors_name_the_flag(tok, tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"body": f"document {i} " * 20}) + "\n" for i in range(40)))
    with pytest.raises(UsageError, match="pass --text_field=KEY"):
        make_loader(str(plain), tok, 32, 4)
    loader = make_loader(str(plain), tok, 32, 4, text_field="body")
    assert loader.chat is None and loader.num_rows > 4
    with pytest.raises(
        UsageError, match="--loss_on, --chat_template apply to chat data|--chat_template, --loss_on apply"
    ):
        make_loader(str(plain), tok, 32, 4, text_field="body", chat_template="chatml", loss_on="assistant")
    assert make_loader(str(plain), tok, 32, 4, text_field="body", loss_on="all").chat is None  # plain text counts all
    chat = chat_file(tmp_path / "chat.jsonl", [CONVERSATION] * 4)
    with pytest.raises(UsageError, match="--chat_template=nope: neither a built-in template"):
        make_loader(chat, tok, 64, 2, chat_template="nope")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(UsageError, match="fix it or pass --chat_template=chatml"):
        make_loader(chat, tok, 64, 2, chat_template=str(broken))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(UsageError, match="message 0 needs a string \"role\" and a string \"content\""):
        make_loader(str(bad), tok, 64, 2)


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(loss_on="replies"), "--loss_on=replies: choose assistant or all"),
        (dict(long_conversations="cut"), "--long_conversations=cut: choose truncate or drop"),
        (dict(text_field=" "), "--text_field is empty"),
    ],
)
def test_bad_chat_flags_are_one_line(flags, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**flags).validate()
