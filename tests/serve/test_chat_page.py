"""The chat page in a real headless browser (Debian's chromium, driven by Playwright)."""

from __future__ import annotations

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
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
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
    reply.and_(page.locator(":is([data-state=done], [data-state=error])")).wait_for()
    return reply


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
