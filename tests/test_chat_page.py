"""The chat page at `/`, driven in a real headless Chromium against a live worker.

What a user relies on: the page loads from the worker alone (nothing from another host), shows the
served model, streams the same answer the API gives for the same conversation and settings, keeps
the conversation across turns, and its Stop button ends the generation on the worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, Request, Route, expect, sync_playwright
from prometheus_client.parser import text_string_to_metric_families

from conftest import Worker

pytestmark = pytest.mark.cpu

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
CHAT_PATH = "/v1/chat/completions"
GENERATION_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make test`, which installs Debian's chromium for these tests")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class ChatPage:
    page: Page
    requests: list[Request] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)

    def chat_requests(self) -> list[Request]:
        return [r for r in self.requests if r.url.endswith(CHAT_PATH)]

    def assistant_texts(self) -> list[str]:
        return self.page.locator(".message.assistant .text").all_text_contents()

    def send(self, text: str) -> None:
        """Type `text` and press Enter; return once the reply is complete."""
        replies = len(self.assistant_texts()) + 1
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")
        self.page.wait_for_function(
            "n => document.querySelectorAll('.message.assistant').length === n"
            " && document.getElementById('log').getAttribute('aria-busy') === 'false'",
            arg=replies, timeout=GENERATION_TIMEOUT_MS)


@pytest.fixture
def chat(browser: Browser, worker: Worker) -> Iterator[ChatPage]:
    context = browser.new_context()  # fresh storage each test
    page = context.new_page()
    recorded = ChatPage(page)
    context.on("request", lambda request: recorded.requests.append(request))
    page.on("console", lambda message: recorded.console_errors.append(message.text)
            if message.type == "error" else None)
    page.on("pageerror", lambda error: recorded.console_errors.append(f"uncaught: {error}"))
    page.goto(f"{worker.base_url}/")
    try:
        yield recorded
    finally:
        context.close()


def served_model(worker: Worker) -> str:
    return httpx.get(f"{worker.base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def greedy_answer(worker: Worker, messages: list[dict[str, str]], max_tokens: int,
                  stop: list[str] | None = None) -> dict[str, Any]:
    """The API's own non-streamed greedy choice for a conversation."""
    body: dict[str, Any] = {"model": served_model(worker), "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0}
    if stop:
        body["stop"] = stop
    response = httpx.post(f"{worker.base_url}{CHAT_PATH}", json=body, timeout=GENERATION_TIMEOUT_MS / 1000)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def metric_values(worker: Worker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{worker.base_url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def cancelled_jobs(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(value for (name, labels), value in metrics.items()
               if name == "llorch_requests_total" and "cancelled" in dict(labels).get("outcome", ""))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href", "action") and value is not None]


def test_the_page_is_html_that_needs_no_other_host(worker: Worker) -> None:
    response = httpx.get(f"{worker.base_url}/", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    links = _Links()
    links.feed(response.text)
    assert not [url for url in links.urls if url.startswith(("http:", "https:", "//"))]
    assert "http://" not in response.text and "https://" not in response.text
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "connect-src 'self'" in policy
    head = httpx.head(f"{worker.base_url}/", timeout=30)  # how Ollama's clients see whether a server is up
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(f"{worker.base_url}/favicon.ico", timeout=30).status_code in (200, 204)


def test_the_page_streams_the_greedy_answer_and_keeps_the_conversation(chat: ChatPage, worker: Worker) -> None:
    page, origin, model = chat.page, worker.base_url, served_model(worker)
    expect(page.locator("#model")).to_have_text(model)
    expect(page.locator("#status")).to_have_text("Ready")

    system = "You answer in one short sentence."
    page.fill("#system", system)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")
    page.fill("#stop", "zzz, qqq")
    page.fill("#api-key", "page-key")
    page.press("#api-key", "Tab")  # the key is taken on change

    page.fill("#input", "Write about the sea.")
    page.press("#input", "Shift+Enter")  # a new line, not a send
    page.type("#input", "Two lines.")
    assert page.input_value("#input") == "Write about the sea.\nTwo lines."
    assert chat.chat_requests() == []
    first = page.input_value("#input")
    chat.send(first)

    shown = chat.assistant_texts()
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    request = chat.chat_requests()[0]
    body = request.post_data_json
    assert {k: body[k] for k in ("model", "messages", "stream", "temperature", "max_tokens", "stop")} == {
        "model": model, "messages": conversation, "stream": True, "temperature": 0, "max_tokens": 8,
        "stop": ["zzz", "qqq"]}
    assert request.all_headers()["authorization"] == "Bearer page-key"
    expected = greedy_answer(worker, conversation, 8, ["zzz", "qqq"])["message"]["content"]
    assert expected  # the comparison below means something only if the model said anything
    assert shown == [expected]

    second = "Say more."
    chat.send(second)
    conversation += [{"role": "assistant", "content": expected}, {"role": "user", "content": second}]
    assert chat.chat_requests()[1].post_data_json["messages"] == conversation  # the whole conversation, again
    assert chat.assistant_texts() == [expected, greedy_answer(worker, conversation, 8, ["zzz", "qqq"])["message"][
        "content"]]

    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    chat.send("Hello.")
    assert chat.chat_requests()[2].post_data_json["messages"] == [
        {"role": "system", "content": system}, {"role": "user", "content": "Hello."}]

    assert chat.console_errors == []
    assert [r.url for r in chat.requests if not r.url.startswith(origin + "/")] == []


def test_stop_ends_the_generation_on_the_worker(chat: ChatPage, worker: Worker) -> None:
    page, prompt = chat.page, "Tell me a long story about a dragon who guards a library."
    full = greedy_answer(worker, [{"role": "user", "content": prompt}], 200)
    assert full["finish_reason"] == "length", "the prompt must make the model write all 200 tokens"
    cancelled_before = cancelled_jobs(metric_values(worker))

    expect(page.locator("#status")).to_have_text("Ready")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "200")
    page.fill("#input", prompt)
    page.press("#input", "Enter")
    # Text on the page while the reply is still being written: it is streamed, not shown at the end.
    page.wait_for_function("() => (document.querySelector('.message.assistant .text')?.textContent ?? '').length > 0"
                           " && document.getElementById('log').getAttribute('aria-busy') === 'true'",
                           timeout=GENERATION_TIMEOUT_MS)
    page.click("#stop-button")
    expect(page.locator("#log")).to_have_attribute("aria-busy", "false")
    expect(page.locator("#status")).to_have_text("Stopped")
    expect(page.locator(".message.assistant .note")).to_have_text("stopped")

    shown = chat.assistant_texts()[0]
    assert shown and full["message"]["content"].startswith(shown)
    assert len(shown) < len(full["message"]["content"])

    deadline = time.monotonic() + 10
    while True:
        metrics = metric_values(worker)
        idle = metrics[("llorch_running_jobs", ())] == 0 and metrics[("llorch_queue_depth", ())] == 0
        if idle and cancelled_jobs(metrics) == cancelled_before + 1:
            break
        assert time.monotonic() < deadline, f"the job was not cancelled: {json.dumps(list(metrics.items()))[:2000]}"
        time.sleep(0.2)
    assert chat.console_errors == []


def test_errors_are_shown_and_the_turn_can_be_sent_again(chat: ChatPage, worker: Worker) -> None:
    page = chat.page
    expect(page.locator("#status")).to_have_text("Ready")

    page.fill("#stop", "a, b, c, d, e")
    page.fill("#input", "Hi")
    page.press("#input", "Enter")
    expect(page.locator("#status")).to_have_text("At most 4 stop sequences (5 given)")
    assert chat.chat_requests() == []
    page.fill("#stop", "")

    # Refused by the worker before any token: its own message, and the text back in the box.
    page.fill("#max-tokens", "100000000")
    page.press("#input", "Enter")
    refused = httpx.post(f"{worker.base_url}{CHAT_PATH}", timeout=30, json={
        "model": served_model(worker), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100000000,
        "stream": True, "temperature": 0.7})
    assert refused.status_code == 400
    expect(page.locator("#status")).to_have_text(refused.json()["error"]["message"])
    expect(page.locator("#status")).to_have_class("error")
    expect(page.locator(".message")).to_have_count(0)
    assert page.input_value("#input") == "Hi"

    # An error chunk in the middle of a stream (what the worker sends when a job fails after it started).
    def failing_stream(route: Route) -> None:
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "Once upon"}, "finish_reason": None}]}
        error = {"error": {"message": "The job was cancelled: the worker is shutting down", "type": "server_error",
                           "param": None, "code": "cancelled"}}
        route.fulfill(status=200, content_type="text/event-stream",
                      body=f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n")

    page.route(f"**{CHAT_PATH}", failing_stream)
    page.fill("#max-tokens", "8")
    page.press("#input", "Enter")
    expect(page.locator("#status")).to_have_text("The job was cancelled: the worker is shutting down")
    expect(page.locator(".message")).to_have_count(0)
    assert [e for e in chat.console_errors if e.startswith("uncaught")] == []
