"""The chat page in a real headless browser (Debian's chromium, driven by Playwright).

The test server's context is 256 tokens (conftest.MAX_SEQ_LEN), so a few turns fill it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (.ci/run installs it)")

# Watches the newest assistant reply and records its text after every change, to tell a reply that
# streamed in from one that appeared all at once.
RECORD_REPLY_TEXT = """() => {
  window.replyTexts = [];
  new MutationObserver(() => {
    const replies = document.querySelectorAll(".message.assistant");
    const reply = replies[replies.length - 1];
    if (reply) window.replyTexts.push(reply.textContent);
  }).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()


def open_chat(page, url: str) -> None:
    """Opens the page with short, greedy replies set in its settings."""
    page.goto(url)
    page.click("#settings summary")
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")


def ask(page, text: str):
    """Types `text`, sends it with Enter, and returns the reply's element once the reply has ended."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    reply = page.locator(".message.assistant").last
    reply.and_(page.locator(":is([data-state=done], [data-state=error], [data-state=stopped])")).wait_for()
    return reply


# Clicks "Stop" as soon as the reply being streamed shows its first text.
STOP_AT_FIRST_TEXT = """() => {
  const observer = new MutationObserver(() => {
    const reply = document.querySelector(".message.assistant[data-state=streaming]");
    if (reply && reply.textContent) {
      observer.disconnect();
      document.getElementById("send").click();
    }
  });
  observer.observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
}"""


def record_chat_requests(page) -> list[dict]:
    """The body of every request the page sends to /v1/chat/completions from now on, in order, each with
    the status it was answered with under "status"."""
    sent: list[dict] = []

    def on_response(response):
        if response.url.endswith("/v1/chat/completions"):
            sent.append({**json.loads(response.request.post_data), "status": response.status})

    page.on("response", on_response)
    return sent


def user_message(turn: int) -> str:
    """A user message long enough (about 50 bytes) that a few turns fill the 256-token context."""
    return f"Turn {turn}: " + " ".join(f"word{turn}x{i}" for i in range(5))


def assert_no_error(page) -> None:
    errors = page.locator(".message.error")
    assert errors.count() == 0, errors.all_text_contents()


def test_chat_page_streams_a_reply(page, server, engine):
    open_chat(page, server)
    page.locator("#model").filter(has_text=engine.model_name).wait_for()
    page.evaluate(RECORD_REPLY_TEXT)

    reply = ask(page, "Hello there")
    assert reply.get_attribute("data-state") == "done", reply.text_content()
    assert page.locator(".message.user").last.text_content() == "Hello there"
    text = reply.text_content()
    assert text
    seen = [t for t in page.evaluate("window.replyTexts") if t]
    assert len(set(seen)) >= 2 and all(text.startswith(t) for t in seen), f"did not stream: {seen}"

    # The second turn carries the first: the page keeps the conversation.
    second = ask(page, "And then?")
    assert second.get_attribute("data-state") == "done"
    assert page.locator(".message.assistant").count() == 2


def test_chat_page_sends_the_api_key(page, keyed_server, api_key):
    open_chat(page, keyed_server)
    page.locator("#model").filter(has_text="API key").wait_for()  # /v1/models refused: the page says why

    refused = ask(page, "Hello")
    assert refused.get_attribute("data-state") == "error"
    assert "API key" in refused.text_content()

    page.fill("#api-key", api_key)
    page.press("#api-key", "Tab")  # "change" fires on leaving the field
    answered = ask(page, "Hello")
    assert answered.get_attribute("data-state") == "done", answered.text_content()


def test_chat_page_replies_at_a_default_length(page, server):
    """With nothing set, a reply gets a quarter of the 256-token context, shown in Settings."""
    page.goto(server)
    page.locator("#model").filter(has_text="256-token context").wait_for()
    page.click("#settings summary")
    assert page.input_value("#max-tokens") == "64"
    sent = record_chat_requests(page)
    page.fill("#temperature", "0")

    reply = ask(page, "Hello there")
    assert reply.get_attribute("data-state") == "done", reply.text_content()
    assert [body["max_tokens"] for body in sent] == [64]


def test_long_conversation_leaves_out_the_oldest_turns(page, server):
    """Eight long turns in a 256-token context: every reply arrives, the oldest turns are left out of the
    requests (and the page says so), and the newest turns are always sent."""
    open_chat(page, server)
    page.locator("#model").filter(has_text="256-token context").wait_for()
    sent = record_chat_requests(page)

    for turn in range(8):
        reply = ask(page, user_message(turn))
        assert reply.get_attribute("data-state") == "done", reply.text_content()
        assert_no_error(page)
    assert page.locator(".message.assistant[data-state=done]").count() == 8

    assert all(body["status"] == 200 and body["max_tokens"] == 24 for body in sent), sent  # the estimate was enough
    contents = [[m["content"] for m in body["messages"]] for body in sent]
    assert len(contents[-1]) < 2 * 8 - 1, "no turn was left out"
    for turn, messages in enumerate(contents):
        assert messages[-1] == user_message(turn)
        if turn:  # the previous turn is always sent, and whatever is sent is the newest turns in order
            assert messages[-3] == user_message(turn - 1)
            assert messages[0] == user_message(turn - (len(messages) - 1) // 2)

    left_out = 8 - (len(contents[-1]) + 1) // 2
    note = page.locator(".note")
    assert note.is_visible()
    assert note.text_content() == f"{left_out} earlier turns left out to fit the model's 256-token context"
    assert page.locator(".message.left-out").count() == 2 * left_out
    # The note follows the last turn left out.
    assert page.locator(".message.left-out").last.evaluate("e => e.nextElementSibling.className") == "note"


def test_long_conversation_keeps_a_stopped_reply(page, server, engine):
    """A server that does not say its context (no max_model_len): the page learns it from the server's
    400s, leaving out one more turn and asking again. A reply stopped half-way is sent with the next turn."""

    def models_without_context(route):
        response = route.fetch()
        body = response.json()
        for card in body["data"]:
            del card["max_model_len"]
        route.fulfill(response=response, json=body)

    page.route("**/v1/models", models_without_context)
    open_chat(page, server)
    page.locator("#model").filter(has_text=engine.model_name).wait_for()
    assert "context" not in page.text_content("#model")
    sent = record_chat_requests(page)

    stopped_text = None
    for turn in range(7):
        if turn == 2:
            page.evaluate(STOP_AT_FIRST_TEXT)
        reply = ask(page, user_message(turn))
        if turn == 2:
            assert reply.get_attribute("data-state") == "stopped", reply.text_content()
            stopped_text = reply.text_content()
            assert stopped_text
        else:
            assert reply.get_attribute("data-state") == "done", reply.text_content()
        assert_no_error(page)
        assert page.text_content("#send") == "Send"

    turns = []  # the messages of the request each turn's reply came from
    for body in sent:
        if body["status"] == 200:
            turns.append(body["messages"])
        else:
            assert body["status"] == 400
    assert len(turns) == 7
    assert len(sent) > 7, "the context never filled up"
    after_stop = turns[3]
    assert {"role": "assistant", "content": stopped_text} in after_stop
    assert after_stop[-1] == {"role": "user", "content": user_message(3)}

    note = page.locator(".note")
    assert note.is_visible()
    assert note.text_content().endswith("left out to fit the model's context")


def test_reply_length_beyond_the_context(page, server):
    """Max tokens set past the context: the server refuses it, and the page asks for the rest of the context."""
    open_chat(page, server)
    page.locator("#model").filter(has_text="256-token context").wait_for()
    page.fill("#max-tokens", "1000")
    sent = record_chat_requests(page)

    for turn in range(2):
        reply = ask(page, user_message(turn))
        assert reply.get_attribute("data-state") == "done", reply.text_content()
        assert_no_error(page)
    assert [(body["status"], body.get("max_tokens")) for body in sent[:2]] == [(400, 1000), (200, None)]
    assert sent[-1]["status"] == 200 and len(sent[-1]["messages"]) == 1  # the first turn filled the context
    assert page.locator(".note").text_content() == "1 earlier turn left out to fit the model's 256-token context"
