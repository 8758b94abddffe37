"""A chat request to a model folder of Qwen's, Gemma's or Mistral's shape: the server prompts the model
with exactly the tokens chat fine-tuning trains on before the reply, and stops the reply at the
template's end-of-turn marker."""

import httpx
import pytest

from meshlm.data.chat import encode_conversation
from meshlm.data.chat_template import resolve_chat_template
from meshlm.serve.api.routes import create_app
from meshlm.serve.loading import read_chat_template
from tests.support.chat_families import CONVERSATION, FAMILIES, family_tokenizers


class _ModelFolder:
    """The test engine as `load_model` would give it for a model folder: that folder's tokenizer and
    chat template; the requests it is sent are kept."""

    def __init__(self, engine, tokenizer):
        self._engine, self.tokenizer = engine, tokenizer
        self.chat_template = read_chat_template({p.name: p for p in tokenizer.path.parent.iterdir()})
        self.requests = []

    def submit_batch(self, requests):
        self.requests.extend(requests)
        return self._engine.submit_batch(requests)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return family_tokenizers(tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_served_prompt_is_the_trained_one_and_stops_at_the_end_of_turn(engine, serve_app, toks, family):
    tok = toks[family]
    # Mistral's own template moves a system prompt to the last user turn, which training cannot follow
    conversation = CONVERSATION[1:3] if family == "mistral" else CONVERSATION[:3]
    model = _ModelFolder(engine, tok)
    with serve_app(create_app(model)) as url, httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json={"messages": conversation[:-1], "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    [request] = model.requests
    template, origin = resolve_chat_template(None, tok)  # what chat fine-tuning renders with
    ids, weights = encode_conversation(template, tok, conversation)
    prompt = request.prompt_ids
    assert origin == "the tokenizer's own" and ids[: len(prompt)] == prompt and weights[len(prompt)] == 1
    assert not any(weights[: len(prompt)])
    assert request.stop == (FAMILIES[family][4],)
    assert tok.decode(prompt).count("Be brief.") == (family != "mistral")  # Gemma folds it into the user's turn
