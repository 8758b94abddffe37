"""The chat formats of Qwen (ChatML), Gemma and Mistral: a tokenizer's own template of each shape and the
built-in template of the same name render alike, training renders what serving prompts, the loss counts
each reply's text and end-of-turn marker only, and Gemma keeps a system message inside the first turn."""

import pytest

from meshlm.data import Tokenizer
from meshlm.data.chat import ChatData, encode_conversation
from meshlm.data.chat_template import BUILTIN, ChatTemplate, resolve_chat_template
from meshlm.errors import UsageError
from meshlm.serve.loading import read_chat_template
from tests.support.chat_families import CONVERSATION, FAMILIES, family_tokenizers

NO_SYSTEM = CONVERSATION[1:]
# What a reply is rendered as between the generation prompt and the next turn.
REPLY = {"qwen": "{}<|im_end|>", "gemma": "{}<end_of_turn>", "mistral": " {}</s>"}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return family_tokenizers(tmp_path_factory.mktemp("families"))


def served_template(tok) -> ChatTemplate:
    """The template `meshlm serve` renders a chat request with: read from the model folder's files,
    special tokens from its tokenizer (meshlm.serve.loading, meshlm.serve.api.routes)."""
    files = {p.name: p for p in tok.path.parent.iterdir()}
    return ChatTemplate.from_source(read_chat_template(files), bos_token=tok.bos_token, eos_token=tok.eos_token)


def conversation_for(family):
    # the shipped Mistral template moves the system prompt to the last user turn: train without one
    return NO_SYSTEM if family == "mistral" else CONVERSATION


@pytest.mark.parametrize("family", FAMILIES)
def test_training_tokens_before_each_reply_are_the_served_prompt(toks, family):
    tok = toks[family]
    template, origin = resolve_chat_template(None, tok)
    served = served_template(tok)
    assert origin == "the tokenizer's own" and template == served
    conversation = conversation_for(family)
    ids, weights = encode_conversation(template, tok, conversation)
    prompts = 0
    for k, m in enumerate(conversation):
        if m["role"] == "assistant":
            prompt = tok.encode(served.render(conversation[:k]))  # as the server encodes a chat request
            assert ids[: len(prompt)] == prompt, k
            assert weights[len(prompt) - 1] == 0 and weights[len(prompt)] == 1
            prompts += 1
    assert prompts == 2
    bos = FAMILIES[family][2]
    if bos:  # the special tokens come from tokenizer_config.json, as transformers renders them
        assert ids[0] == tok.encode(bos)[0] and tok.bos_token == bos


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("source", ["own", "builtin"])
def test_the_loss_counts_each_reply_and_its_end_of_turn_marker(toks, family, source):
    tok = toks[family]
    template, _ = resolve_chat_template(None if source == "own" else FAMILIES[family][1], tok)
    conversation = conversation_for(family)
    ids, weights = encode_conversation(template, tok, conversation)
    counted = tok.decode([i for i, w in zip(ids, weights) if w])
    replies = [REPLY[family].format(m["content"]) for m in conversation if m["role"] == "assistant"]
    assert counted == "".join(replies)  # no role header, no newline after the marker, no appended end of text
    assert ids[-1] == tok.eos_id and weights[-1] == 0 or tok.eos_token == FAMILIES[family][4]
    _, all_weights = encode_conversation(template, tok, conversation, loss_on="all")
    assert all_weights == [0] + [1] * (len(ids) - 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_template_stops_at_its_end_of_turn(toks, family):
    tok = toks[family]
    stop = FAMILIES[family][4]
    assert served_template(tok).stop == (stop,)
    assert resolve_chat_template(FAMILIES[family][1], tok)[0].stop == (stop,)


@pytest.mark.parametrize(
    "family,conversations",
    [
        ("qwen", [CONVERSATION, CONVERSATION[:2], CONVERSATION[:3]]),
        ("gemma", [CONVERSATION, NO_SYSTEM, CONVERSATION[:2], CONVERSATION[:4]]),
        # the shipped Mistral template and the built-in agree but where a system prompt goes in a
        # conversation of several user turns (first turn here, last turn there)
        ("mistral", [NO_SYSTEM, NO_SYSTEM[:1], NO_SYSTEM[:3], CONVERSATION[:2]]),
    ],
)
def test_the_builtin_renders_what_the_family_ships(toks, family, conversations):
    tok = toks[family]
    own = served_template(tok)
    builtin, origin = resolve_chat_template(FAMILIES[family][1], tok)
    assert origin == FAMILIES[family][1] and builtin.source == BUILTIN[origin]
    for conversation in conversations:
        for generation_prompt in (True, False):
            expected = own.render(conversation, add_generation_prompt=generation_prompt)
            assert builtin.render(conversation, add_generation_prompt=generation_prompt) == expected


def test_gemma_folds_the_system_message_into_the_first_user_turn(toks):
    tok = toks["gemma"]
    first_turn = "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n"
    for template in (served_template(tok), resolve_chat_template("gemma", tok)[0]):
        assert template.render(CONVERSATION[:2]) == first_turn
        ids, weights = encode_conversation(template, tok, CONVERSATION)
        assert "Be brief." in tok.decode(ids) and "system" not in tok.decode(ids)
        assert "Be brief." not in tok.decode([i for i, w in zip(ids, weights) if w])
    alone = resolve_chat_template("gemma", tok)[0].render(CONVERSATION[:1])  # a system message alone: the user's turn
    assert alone == "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"


def test_mistral_system_prompt_opens_the_first_instruction(toks):
    tok = toks["mistral"]
    builtin = resolve_chat_template("mistral", tok)[0]
    assert builtin.render(CONVERSATION) == (
        "<s>[INST] Be brief.\n\nWhat is 2 + 2?[/INST] 4.</s>[INST] And twice that?[/INST] Eight, since 2 × 4 = 8.</s>"
    )
    ids, weights = encode_conversation(builtin, tok, CONVERSATION)  # trains with the system prompt kept
    assert tok.decode([i for i, w in zip(ids, weights) if w]) == " 4.</s> Eight, since 2 × 4 = 8.</s>"
    with pytest.raises(UsageError, match=r"renders turns before reply 2 differently .*--chat_template=.*mistral"):
        encode_conversation(served_template(toks["mistral"]), toks["mistral"], CONVERSATION)


def test_a_run_serves_with_the_template_and_special_tokens_it_trained_with(toks, tmp_path):
    tok = toks["gemma"]
    template, origin = resolve_chat_template("gemma", tok)
    tok.save(tmp_path / "run")  # as a run keeps its tokenizer (meshlm.train.setup), then the template
    ChatData(None, None, template, origin, {}).save_template(tmp_path / "run")
    served = served_template(Tokenizer.from_file(tmp_path / "run"))
    assert served == template and served.render(CONVERSATION).startswith("<bos><start_of_turn>user\nBe brief.")
