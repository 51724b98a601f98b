"""The Anthropic Messages API, driven by the official `anthropic` client.

Against the shared worker (the default model through the Gemma family template), answers
are checked against the OpenAI chat API's for the same conversation: one template, one
prompt, one greedy text. Auth and thinking use a tiny model in-process (fast, and its
template can open a thought).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import Worker
from jobs import make_engine
from llorch.api.app import create_app
from llorch.api.state import WorkerState
from llorch.weights.loader import load_model
from tiny_model import write_tiny_gemma3

pytestmark = pytest.mark.cpu

GREEDY = {"temperature": 0}  # Anthropic's client sends sampling fields as extra body fields
SYSTEM = "Answer briefly."
QUESTION = [{"role": "user", "content": "Name a colour."}]
ANY_MODEL = "claude-on-this-worker"  # Anthropic's clients always name a model; the served one answers
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}
FORCE_WEATHER = {"type": "tool", "name": "get_weather"}
API_KEY = "anthropic-test-key"


@pytest.fixture(scope="module")
def claude(worker: Worker) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=worker.base_url, api_key="unused", max_retries=0, timeout=180)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_is_the_greedy_chat_answer_with_its_usage(claude: anthropic.Anthropic, client: openai.OpenAI,
                                                        model_id: str) -> None:
    message = claude.messages.create(model=ANY_MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION,
                                     extra_body=GREEDY)
    chat = client.chat.completions.create(model=model_id, max_tokens=12, temperature=0,
                                          messages=[{"role": "system", "content": SYSTEM}, *QUESTION])
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == model_id
    assert text_of(message) == chat.choices[0].message.content
    assert [block.type for block in message.content] == ["text"]
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.stop_sequence is None


def test_stream_text_and_final_message_equal_the_whole_answer(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=ANY_MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION,
                                   extra_body=GREEDY)
    with claude.messages.stream(model=ANY_MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION,
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def sse_events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every server-sent event, checking that each data's type is its event's name."""
    events = []
    for chunk in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def test_stream_events_come_in_the_documented_order(worker: Worker) -> None:
    body = {"model": ANY_MODEL, "max_tokens": 8, "messages": QUESTION, "stream": True, **GREEDY}
    response = httpx.post(f"{worker.base_url}/v1/messages", json=body, timeout=180,
                          headers={"anthropic-version": "2023-06-01", "anthropic-beta": "some-beta-2025-01-01"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    current, open_block = -1, False
    for name, data in events[2:-2]:  # each block: start, deltas, stop, numbered from 0
        if name == "ping":
            continue
        if name == "content_block_start":
            assert not open_block
            current, open_block = current + 1, True
        else:
            assert open_block and name in ("content_block_delta", "content_block_stop")
            open_block = name == "content_block_delta"
        assert data["index"] == current
    assert current >= 0 and not open_block
    assert events[-2][1]["usage"]["output_tokens"] == 8 and events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_stop_sequence_and_max_tokens_are_the_stop_reasons(claude: anthropic.Anthropic) -> None:
    free = claude.messages.create(model=ANY_MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    text = text_of(free)
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    stopped = claude.messages.create(model=ANY_MODEL, max_tokens=16, messages=QUESTION, stop_sequences=[stop],
                                     extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == text[:text.index(stop)]
    short = claude.messages.create(model=ANY_MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.stop_sequence is None and short.usage.output_tokens == 3


def forced_call(claude: anthropic.Anthropic) -> Any:
    return claude.messages.create(model=ANY_MODEL, max_tokens=64, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER], tool_choice=FORCE_WEATHER,
        extra_body=GREEDY)


def test_tool_use_round_trip_reads_like_the_openai_conversation(claude: anthropic.Anthropic, client: openai.OpenAI,
                                                                model_id: str) -> None:
    called = forced_call(claude)
    assert called.stop_reason == "tool_use"
    uses = [block for block in called.content if block.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    use = uses[0]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    answer = claude.messages.create(model=ANY_MODEL, max_tokens=12, tools=[WEATHER], tool_choice={"type": "none"},
                                    extra_body=GREEDY, messages=[
        question, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert {block.type for block in answer.content} <= {"text"}
    # The same history through the OpenAI API: the same prompt, so the same tokens and the same greedy text.
    chat = client.chat.completions.create(model=model_id, max_tokens=12, temperature=0, tool_choice="none", tools=[
        {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                          "parameters": WEATHER_SCHEMA}}], messages=[
        question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C, sunny"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert text_of(answer) == chat.choices[0].message.content


def test_streamed_tool_input_assembles_to_the_same_input(claude: anthropic.Anthropic) -> None:
    whole = forced_call(claude)
    parts, starts = [], []
    with claude.messages.stream(model=ANY_MODEL, max_tokens=64, messages=[
            {"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
            tool_choice=FORCE_WEATHER, extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_start":
                starts.append(event.content_block.type)
            elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                parts.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert starts and set(starts) == {"tool_use"}
    inputs = [block.input for block in final.content if block.type == "tool_use"]
    assert len(parts) == len(inputs)
    assert [json.loads(part) for part in parts] == inputs
    assert inputs == [block.input for block in whole.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use"


def test_count_tokens_is_the_prompt_a_message_reads(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    counted = claude.messages.count_tokens(model=ANY_MODEL, system=SYSTEM, messages=messages, tools=[WEATHER])
    created = claude.messages.create(model=ANY_MODEL, max_tokens=4, system=SYSTEM, messages=messages,
                                     tools=[WEATHER], tool_choice={"type": "none"}, extra_body=GREEDY)
    plain = claude.messages.count_tokens(model=ANY_MODEL, system=SYSTEM, messages=messages)
    assert counted.input_tokens == created.usage.input_tokens
    assert plain.input_tokens < counted.input_tokens  # the tool list is part of the prompt


def assert_invalid(exc: anthropic.BadRequestError, *fragments: str) -> None:
    assert exc.status_code == 400
    assert exc.body["type"] == "error" and exc.body["error"]["type"] == "invalid_request_error"
    for fragment in fragments:
        assert fragment in exc.body["error"]["message"]


def test_missing_max_tokens_is_a_400_naming_it(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:  # the client's typed create insists on it
        claude.post("/v1/messages", cast_to=object, body={"model": ANY_MODEL, "messages": QUESTION})
    assert_invalid(caught.value, "max_tokens")


def test_an_image_block_is_a_400_naming_it(claude: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=ANY_MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert_invalid(caught.value, "messages.0.content", "image")


@pytest.mark.parametrize("field,value", [("frequency_penalty", 0.5), ("mcp_servers", [{"type": "url", "url": "x"}])])
def test_an_unknown_field_that_could_change_the_output_is_a_400(claude: anthropic.Anthropic, field: str,
                                                                  value: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=ANY_MODEL, max_tokens=4, messages=QUESTION, extra_body={field: value})
    assert_invalid(caught.value, field)


def test_server_tools_and_out_of_range_temperature_are_400s(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=ANY_MODEL, max_tokens=4, messages=QUESTION,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert_invalid(caught.value, "tools", "web_search_20250305")
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=ANY_MODEL, max_tokens=4, messages=QUESTION, extra_body={"temperature": 1.5})
    assert_invalid(caught.value, "temperature")


def test_fields_that_cannot_change_the_output_are_accepted(claude: anthropic.Anthropic) -> None:
    plain = claude.messages.create(model=ANY_MODEL, max_tokens=6, messages=QUESTION, extra_body=GREEDY)
    decorated = claude.messages.create(
        model=ANY_MODEL, max_tokens=6, metadata={"user_id": "u-1"}, service_tier="auto",
        thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=GREEDY,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Name a colour.", "cache_control": {"type": "ephemeral"}}]}])
    assert text_of(decorated) == text_of(plain)


def test_engine_refusals_keep_anthropics_shape(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:  # more than the context holds
        claude.messages.create(model=ANY_MODEL, max_tokens=10_000_000, messages=QUESTION)
    assert_invalid(caught.value, "max_tokens")


def test_output_config_format_constrains_the_answer(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
              "additionalProperties": False}
    message = claude.messages.create(model=ANY_MODEL, max_tokens=32, messages=QUESTION, extra_body=GREEDY,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), schema)


def generated_tokens(worker: Worker) -> float:
    metrics = text_string_to_metric_families(httpx.get(f"{worker.base_url}/metrics").text)
    return next(sample.value for family in metrics for sample in family.samples
                if sample.name == "llorch_generated_tokens_total")


def cancelled_jobs(worker: Worker) -> float:
    metrics = text_string_to_metric_families(httpx.get(f"{worker.base_url}/metrics").text)
    return next((sample.value for family in metrics for sample in family.samples
                 if sample.name == "llorch_requests_total" and sample.labels.get("outcome") == "cancelled"), 0.0)


def kv_bytes_held(worker: Worker) -> float:
    metrics = text_string_to_metric_families(httpx.get(f"{worker.base_url}/metrics").text)
    return next(sample.value for family in metrics for sample in family.samples
                if sample.name == "llorch_kv_cache_bytes")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_its_job(worker: Worker, stream: bool) -> None:
    # At least 1000 numbers: the grammar keeps the job going far longer than the client stays.
    long = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer", "maximum": 9},
                                                   "minItems": 1000}}, "required": ["n"]}
    body = {"model": ANY_MODEL, "max_tokens": 4000, "messages": QUESTION, "stream": stream, **GREEDY,
            "output_config": {"format": {"type": "json_schema", "schema": long}}}
    before, cancelled_before = generated_tokens(worker), cancelled_jobs(worker)
    url = f"{worker.base_url}/v1/messages"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line == "event: content_block_delta":
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=httpx.Timeout(30, read=3))
    deadline = time.monotonic() + 10
    while kv_bytes_held(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_bytes_held(worker) == 0
    generated = generated_tokens(worker) - before
    time.sleep(1)  # nothing goes on generating
    assert generated_tokens(worker) - before == generated
    # Stopped, not finished: counted as cancelled (how many tokens came first depends on the machine's
    # speed; with speculation on a fast one, more than the 2000 the schema's minimum needs)
    assert generated > 0 and cancelled_jobs(worker) == cancelled_before + 1


# -- in-process: a tiny model behind an API key, with a template that opens a thought ---------------------

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'].split('</think>')[-1] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_thinking_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("anthropic-tiny")
    template = root / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    loaded = load_model(write_tiny_gemma3(root / "tiny.gguf"), torch.device("cpu"), torch.float32)
    engine = make_engine(loaded, ctx_size=2048, kv_cache_bytes=16 * 2**20, chat_template_file=str(template))
    state = WorkerState("cpu", "cpu", telemetry=engine.telemetry)
    state.attach(engine)
    yield create_app(state, api_key=API_KEY)
    engine.stop()


def tiny_client(app: Any, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key=key, max_retries=0,
                               http_client=TestClient(app))


def test_the_api_key_goes_in_x_api_key(tiny_thinking_app: Any) -> None:
    counted = tiny_client(tiny_thinking_app, API_KEY).messages.count_tokens(model=ANY_MODEL, messages=QUESTION)
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as caught:
        tiny_client(tiny_thinking_app, "wrong-key").messages.create(model=ANY_MODEL, max_tokens=4, messages=QUESTION)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"


def test_reasoning_comes_back_as_thinking_blocks(tiny_thinking_app: Any) -> None:
    claude = tiny_client(tiny_thinking_app, API_KEY)
    whole = claude.messages.create(model=ANY_MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    # The prompt opened the thought and a random model never closes it: everything it wrote is thinking.
    assert [block.type for block in whole.content] == ["thinking"]
    assert whole.content[0].thinking and whole.stop_reason == "max_tokens"
    thoughts = []
    with claude.messages.stream(model=ANY_MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                assert event.delta.type == "thinking_delta"
                thoughts.append(event.delta.thinking)
        final = stream.get_final_message()
    assert "".join(thoughts) == whole.content[0].thinking == final.content[0].thinking
    chat = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, max_retries=0,
                         http_client=TestClient(tiny_thinking_app)).chat.completions.create(
        model=whole.model, max_tokens=16, temperature=0, messages=QUESTION)
    assert chat.choices[0].message.model_extra["reasoning_content"] == whole.content[0].thinking


def test_loading_worker_answers_503_in_anthropics_shape() -> None:
    app = create_app(WorkerState("cpu", "cpu"))
    claude = anthropic.Anthropic(base_url="http://testserver", api_key="unused", max_retries=0,
                                 http_client=TestClient(app))
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.create(model=ANY_MODEL, max_tokens=4, messages=QUESTION)
    assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"]
    assert caught.value.body["error"]["type"] == "overloaded_error"

