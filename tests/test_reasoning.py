"""A model that thinks gets its thoughts split from its answer, in every API's own field.

The worker serves the default model with a template that opens a `<think>` block in the
generation prompt (tests/data/thinking_turns.jinja), as Qwen3's does. The base model never
closes it within a few tokens, so everything it writes is thought: each API must return
exactly the greedy text of the same prompt (read through /v1/completions) as reasoning, and
no answer. `enable_thinking: false` closes the block in the prompt: then it is all answer.
A grammar that makes the model close the thought checks the split inside the output.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from conftest import Worker, start_worker, stop_worker

TEMPLATE = Path(__file__).parent / "data" / "thinking_turns.jinja"
QUESTION = [{"role": "user", "content": "What colour is the sky?"}]
TOKENS = 8
GREEDY = {"temperature": 0}  # the anthropic client takes sampling settings in the body only


@pytest.fixture(scope="module")
def thinking_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    live = start_worker(tmp_path_factory.mktemp("thinking"), "--chat-template-file", str(TEMPLATE))
    yield live
    stop_worker(live)


@pytest.fixture(scope="module")
def client(thinking_worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinking_worker.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def thought(thinking_worker: Worker, client: openai.OpenAI, model_id: str) -> str:
    """The greedy text after the rendered prompt, which ends inside the opened thought."""
    with thinking_worker.client() as http:
        rendered = http.post("/tokenize", json={"messages": QUESTION, "return_token_strs": True}).json()
    assert rendered["token_strs"][-2:] == ["<think>", "\n"] or "".join(rendered["token_strs"]).endswith("<think>\n")
    text = client.completions.create(model=model_id, prompt=rendered["tokens"], max_tokens=TOKENS, temperature=0)
    assert text.choices[0].finish_reason == "length" and "</think>" not in text.choices[0].text
    return text.choices[0].text


def test_chat_completions_put_the_thought_in_reasoning_content(client: openai.OpenAI, model_id: str,
                                                               thought: str) -> None:
    answer = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=TOKENS, temperature=0)
    message = answer.choices[0].message.model_dump()
    assert message["reasoning_content"] == thought
    assert message["content"] == ""
    stream = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=TOKENS, temperature=0,
                                            stream=True)
    deltas = [chunk.choices[0].delta.model_dump() for chunk in stream if chunk.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    assert not "".join(d.get("content") or "" for d in deltas)


def test_enable_thinking_false_reaches_the_template_and_makes_it_all_answer(thinking_worker: Worker,
                                                                           model_id: str) -> None:
    def split(**extra: object) -> tuple[str | None, str, int]:
        with thinking_worker.client() as http:
            answer = http.post("/v1/chat/completions", json={
                "model": model_id, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "regex": r"Blue\.",
                **extra}).json()
        message = answer["choices"][0]["message"]
        return message.get("reasoning_content"), message["content"], answer["usage"]["prompt_tokens"]

    opened = split()
    closed = split(chat_template_kwargs={"enable_thinking": False})
    assert opened[:2] == ("Blue.", "")  # the prompt opened the thought
    assert closed[:2] == (None, "Blue.")  # the template closed it: an answer
    assert closed[2] > opened[2]  # "\n\n</think>\n\n" in the prompt


def test_a_thought_closed_in_the_output_splits_there(thinking_worker: Worker, model_id: str) -> None:
    with thinking_worker.client() as http:
        answer = http.post("/v1/chat/completions", json={
            "model": model_id, "messages": QUESTION, "max_tokens": 32, "temperature": 0,
            "regex": r"Clouds hide it\.</think>\n\nBlue\."}).json()
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] == "Clouds hide it."
    assert message["content"] == "Blue."


def test_anthropic_messages_return_a_thinking_block(thinking_worker: Worker, thought: str) -> None:
    client = anthropic.Anthropic(base_url=thinking_worker.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(model="any", max_tokens=TOKENS, messages=QUESTION, extra_body=GREEDY)
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking == thought
    with client.messages.stream(model="any", max_tokens=TOKENS, messages=QUESTION, extra_body=GREEDY) as stream:
        deltas = [event.delta.thinking for event in stream
                  if event.type == "content_block_delta" and event.delta.type == "thinking_delta"]
    assert "".join(deltas) == thought


def test_responses_return_a_reasoning_item(client: openai.OpenAI, model_id: str, thought: str) -> None:
    response = client.responses.create(model=model_id, input=QUESTION[0]["content"], max_output_tokens=TOKENS,
                                       temperature=0)
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert len(reasoning) == 1 and reasoning[0].content[0].text == thought
    assert response.output_text == ""


def test_ollama_chat_returns_the_thought_in_thinking(thinking_worker: Worker, model_id: str, thought: str) -> None:
    answer = ollama.Client(host=thinking_worker.base_url).chat(
        model=model_id, messages=QUESTION, think=True, options={"temperature": 0, "num_predict": TOKENS})
    assert answer.message.thinking == thought
    assert answer.message.content == ""
    with httpx.stream("POST", f"{thinking_worker.base_url}/api/chat", json={
            "model": model_id, "messages": QUESTION, "options": {"temperature": 0, "num_predict": TOKENS}}) as lines:
        chunks = [json.loads(line) for line in lines.iter_lines() if line]
    assert "".join(c["message"].get("thinking", "") for c in chunks) == thought
