"""The OpenAI Responses API (/v1/responses), driven by the official `openai` client against a real worker."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from conftest import Worker
from llorch.api.reasoning import ReasoningParser
from llorch.api.response_store import ResponseStore
from llorch.api.responses_output import OutputBuilder
from llorch.api.turn import Turn
from llorch.engine.request import End, StopReason, TokenText

pytestmark = pytest.mark.cpu

INSTRUCTIONS = "Answer briefly."
QUESTION = "Name a colour."
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                     "parameters": WEATHER, "strict": True}]
FORCE_WEATHER: Any = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


class City(BaseModel):
    name: str = Field(max_length=12)
    is_capital: bool
    size: Literal["small", "medium", "large"]


def greedy(client: openai.OpenAI, model_id: str, **kwargs: Any) -> Any:
    return client.responses.create(model=model_id, temperature=0, **kwargs)


def test_text_answer_is_the_greedy_chat_answer_with_its_usage(client: openai.OpenAI, model_id: str) -> None:
    response = greedy(client, model_id, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=16)
    chat = client.chat.completions.create(model=model_id, temperature=0, max_tokens=16, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == model_id
    assert response.output_text == chat.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    details = response.incomplete_details
    assert (details is not None and details.reason == "max_output_tokens") == cut
    assert response.instructions == INSTRUCTIONS and response.temperature == 0


def test_input_items_equal_the_same_conversation_as_a_string(client: openai.OpenAI, model_id: str) -> None:
    as_string = greedy(client, model_id, input=QUESTION, max_output_tokens=8)
    as_items = greedy(client, model_id, max_output_tokens=8, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert as_items.output_text == as_string.output_text
    assert as_items.usage.input_tokens == as_string.usage.input_tokens  # type: ignore[union-attr]


def test_stream_events_come_in_order_and_build_the_response(client: openai.OpenAI, model_id: str) -> None:
    whole = greedy(client, model_id, input=QUESTION, max_output_tokens=12)
    events = list(greedy(client, model_id, input=QUESTION, max_output_tokens=12, stream=True))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert final.type == ("response.completed" if whole.status == "completed" else "response.incomplete")
    text_events = [k for k in kinds[2:-1] if k != "response.output_text.delta"]
    assert text_events == ["response.output_item.added", "response.content_part.added", "response.output_text.done",
                           "response.content_part.done", "response.output_item.done"]
    first_delta, last_delta = kinds.index("response.output_text.delta"), len(kinds) - 1 - kinds[::-1].index(
        "response.output_text.delta")
    assert kinds.index("response.content_part.added") < first_delta < last_delta < kinds.index(
        "response.output_text.done")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.response.output_text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.response.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


def test_stream_helper_returns_the_final_response(client: openai.OpenAI, model_id: str) -> None:
    # The helper's final response needs response.completed: a bounded JSON answer ends before max_output_tokens.
    whole = client.responses.parse(model=model_id, input="Describe Paris.", text_format=City, temperature=0,
                                   max_output_tokens=48)
    with client.responses.stream(model=model_id, input="Describe Paris.", text_format=City, temperature=0,
                                 max_output_tokens=48) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == deltas == whole.output_text
    assert final.output_parsed == whole.output_parsed and isinstance(final.output_parsed, City)
    assert final.id != whole.id


def test_forced_function_call_round_trip(client: openai.OpenAI, model_id: str) -> None:
    question = {"type": "message", "role": "user", "content": "What is the weather in Paris?"}
    called = greedy(client, model_id, input=[question], tools=TOOLS, tool_choice=FORCE_WEATHER,
                    parallel_tool_calls=False, max_output_tokens=64)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and called.status == "completed"  # one call: the grammar ends the turn after it
    assert [item.type for item in called.output] == ["function_call"]
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}

    # The whole conversation sent back as items ...
    explicit = greedy(client, model_id, input=[question, *[item.model_dump(exclude_none=True) for item in
                                                           called.output], result],
                      tools=TOOLS, tool_choice="none", max_output_tokens=16)
    # ... and the same conversation continued from the stored response: the same prompt, the same answer.
    continued = greedy(client, model_id, previous_response_id=called.id, input=[result], tools=TOOLS,
                       tool_choice="none", max_output_tokens=16)
    for answer in (explicit, continued):
        assert [item.type for item in answer.output] == ["message"]
    assert explicit.usage.input_tokens > called.usage.input_tokens  # type: ignore[union-attr]
    assert continued.usage.input_tokens == explicit.usage.input_tokens  # type: ignore[union-attr]
    assert continued.output_text == explicit.output_text
    assert continued.previous_response_id == called.id


def test_function_call_streams_its_arguments(client: openai.OpenAI, model_id: str) -> None:
    events = list(greedy(client, model_id, input="Weather in Oslo?", tools=TOOLS, tool_choice="required",
                         parallel_tool_calls=False, max_output_tokens=64, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    final = events[-1].response
    call = next(item for item in final.output if item.type == "function_call")
    assert deltas == done.arguments == call.arguments and done.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.item.call_id == call.call_id and added.item.arguments == ""


def test_json_schema_format_gives_valid_json(client: openai.OpenAI, model_id: str) -> None:
    schema = City.model_json_schema() | {"additionalProperties": False}
    response = greedy(client, model_id, input="Describe Paris as JSON.", max_output_tokens=48,
                      text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_parse_returns_the_pydantic_object(client: openai.OpenAI, model_id: str) -> None:
    parsed = client.responses.parse(model=model_id, input="Describe Paris.", text_format=City, temperature=0,
                                    max_output_tokens=48)
    assert isinstance(parsed.output_parsed, City)
    assert parsed.output_parsed == City.model_validate_json(parsed.output_text)


def test_stored_responses_can_be_retrieved_and_deleted(client: openai.OpenAI, model_id: str) -> None:
    response = greedy(client, model_id, input=QUESTION, max_output_tokens=4, metadata={"topic": "colours"})
    stored = client.responses.retrieve(response.id)
    assert stored.model_dump() == response.model_dump()
    assert stored.metadata == {"topic": "colours"}
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(response.id)
    assert response.id in gone.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_store_false_keeps_nothing(client: openai.OpenAI, model_id: str) -> None:
    response = greedy(client, model_id, input=QUESTION, max_output_tokens=4, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        greedy(client, model_id, input=QUESTION, max_output_tokens=4, previous_response_id=response.id)
    assert unknown.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert response.id in unknown.value.message


@pytest.mark.parametrize(("kwargs", "status", "param", "named"), [
    ({"tools": [{"type": "web_search"}]}, 400, "tools", "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     400, "input", "input_image"),
    ({"model": "gpt-4o"}, 404, "model", "gpt-4o"),
    ({"truncation": "auto"}, 400, "truncation", "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include", "reasoning.encrypted_content"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400, "input.0.call_id",
     "call_x"),
])
def test_unsupported_requests_are_refused_naming_the_field(client: openai.OpenAI, model_id: str,
                                                           kwargs: dict[str, Any], status: int, param: str,
                                                           named: str) -> None:
    request: dict[str, Any] = {"model": model_id, "input": QUESTION, "max_output_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(**request)
    assert refused.value.status_code == status
    assert refused.value.body["param"].startswith(param)  # type: ignore[index]
    assert named in refused.value.message


def test_context_overflow_names_max_output_tokens(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model_id, input=QUESTION, max_output_tokens=10_000_000)
    assert refused.value.body["param"] == "max_output_tokens"  # type: ignore[index]


COUNTING = "List the numbers from 1 to 500: 1, 2, 3,"


def metric(worker: Worker, name: str) -> float:
    text = httpx.get(f"{worker.base_url}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def stops_generating(worker: Worker, before: float) -> float:
    """Tokens generated since `before` once no job runs; asserts none are generated afterwards."""
    deadline = time.monotonic() + 10
    while metric(worker, "llorch_running_jobs") and time.monotonic() < deadline:
        time.sleep(0.05)
    generated = metric(worker, "llorch_generated_tokens_total") - before
    time.sleep(1)
    assert metric(worker, "llorch_generated_tokens_total") - before == generated
    return generated


def test_a_client_that_leaves_a_stream_stops_its_job(client: openai.OpenAI, worker: Worker, model_id: str) -> None:
    before = metric(worker, "llorch_generated_tokens_total")
    with greedy(client, model_id, input=COUNTING, max_output_tokens=2048, stream=True) as stream:
        next(event for event in stream if event.type == "response.output_text.delta")
    assert stops_generating(worker, before) < 2048


def test_a_client_that_leaves_a_whole_response_stops_its_job(worker: Worker, model_id: str) -> None:
    before = metric(worker, "llorch_generated_tokens_total")
    body = {"model": model_id, "input": COUNTING, "max_output_tokens": 2048, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{worker.base_url}/v1/responses", json=body, timeout=httpx.Timeout(30, read=1.5))
    assert stops_generating(worker, before) < 2048


def test_a_thinking_model_gets_a_reasoning_item_before_its_message() -> None:
    """The builder alone (no model here thinks): thoughts become a reasoning item, streamed before the answer."""
    skeleton: dict[str, Any] = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    builder = OutputBuilder(skeleton, Turn(ReasoningParser.for_prompt(("<think>", "</think>"), "<start>")), 5)
    events = builder.started()
    for index, piece in enumerate(["<th", "ink>", "Paris is", " big.", "</think>", "Blue", "."]):
        events += builder.feed(TokenText(piece, index))
    events += builder.feed(End(7, 1.0, StopReason.EOS))
    output = builder.response["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Paris is big."}]
    assert output[1]["content"][0]["text"] == "Blue."
    kinds = [event["type"] for event in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Paris is big."
    assert builder.response["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_store_evicts_the_oldest_past_its_count_or_bytes() -> None:
    def response(index: int, text: str = "") -> dict[str, Any]:
        return {"id": f"resp_{index}", "output": [text]}

    by_count = ResponseStore(max_count=2, max_bytes=1 << 20)
    for index in range(3):
        by_count.put(response(index), [])
    assert by_count.get("resp_0") is None and by_count.get("resp_1") is not None and len(by_count) == 2

    by_bytes = ResponseStore(max_count=100, max_bytes=1000)
    for index in range(4):
        by_bytes.put(response(index, "x" * 300), [{"type": "message", "role": "user", "content": "hi"}])
    assert by_bytes.bytes <= 1000
    assert [by_bytes.get(f"resp_{i}") is not None for i in range(4)] == [False, False, True, True]
    stored = by_bytes.get("resp_3")
    assert stored is not None and stored.response == response(3, "x" * 300)
    assert by_bytes.delete("resp_3") and not by_bytes.delete("resp_3") and len(by_bytes) == 1
