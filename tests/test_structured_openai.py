"""Structured output, tool calls and chat on the default model, through the official client and LangChain."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from conftest import Worker
from llorch.api.tool_calls import HERMES, LLAMA3, MAX_PARALLEL_CALLS, MISTRAL, ToolCallParser, format_for
from llorch.weights.chat_families import GEMMA, family_for
from llorch.weights.chat_template import ChatTemplate

pytestmark = pytest.mark.cpu

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    is_capital: bool


def test_the_default_model_answers_chat_through_its_family_template(worker: Worker, client: openai.OpenAI,
                                                                    model_id: str) -> None:
    listed = httpx.get(f"{worker.base_url}/v1/models").json()["data"][0]
    assert listed["chat_template"] == "family:gemma"
    reply = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content.strip()


def test_parse_returns_a_pydantic_object(client: openai.OpenAI, model_id: str) -> None:
    completion = client.chat.completions.parse(
        model=model_id, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=120, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City), completion.choices[0].message.content


def test_json_object_mode_gives_an_object(client: openai.OpenAI, model_id: str) -> None:
    reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "A JSON object:"}],
                                           response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # a free object may run long: what there is still opens one
        assert reply.choices[0].message.content.startswith("{")


# Schemas the model can always finish within max_tokens: bounded strings and arrays.
_leaf = st.one_of(
    st.just({"type": "integer", "minimum": -50, "maximum": 50}),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(lambda values: {"enum": values}, st.lists(st.sampled_from(["red", "green", "blue", "x y"]),
                                                         min_size=1, max_size=3, unique=True)),
    st.just({"type": "string", "pattern": "^[a-z]{2,4}$"}),
)
_schemas = st.recursive(_leaf, lambda inner: st.one_of(
    st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 3)),
    st.builds(lambda props, required: {
        "type": "object", "properties": props, "additionalProperties": False,
        "required": [k for k in props if k in required]},
        st.dictionaries(st.sampled_from(["a", "b", "name", "n2"]), inner, min_size=1, max_size=3),
        st.sets(st.sampled_from(["a", "b", "name", "n2"]))),
), max_leaves=5)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=_schemas, stream=st.booleans())
def test_json_schema_output_validates(client: openai.OpenAI, model_id: str, schema: dict[str, Any],
                                      stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": model_id, "max_tokens": 200, "temperature": 0, "messages": [
        {"role": "user", "content": "Fill in this JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["stop"], text
    else:
        reply = client.chat.completions.create(**kwargs)
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "minLength": 9, "maxLength": 2}}}},
     "response_format.json_schema.schema", "Unsatisfiable"),
    ({"extra_body": {"regex": "(unclosed"}}, "regex", "unclosed"),
    ({"extra_body": {"grammar": "start: missing"}}, "grammar", "missing"),
    ({"extra_body": {"regex": "a", "grammar": 'start: "a"'}}, None, "at most one output constraint"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "not among"),
])
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI, model_id: str, extra: dict[str, Any],
                                                   param: str | None, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=ASK, max_tokens=4, **extra)
    body = caught.value.body
    assert fragment in body["message"]
    if param:
        assert body["param"] == param


def test_worker_api_takes_json_schema_and_grammar(worker: Worker) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with httpx.stream("POST", f"{worker.base_url}/execute", json={
            "job_id": "ws-1", "prompt": "Answer in JSON:", "max_tokens": 30, "temperature": 0.0,
            "json_schema": schema}, timeout=120) as response:
        lines = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data:")]
    text = "".join(e["t"] for e in lines if e["type"] == "token")
    jsonschema.validate(json.loads(text), schema)
    bad = httpx.post(f"{worker.base_url}/execute", json={"job_id": "ws-2", "prompt": "x", "max_tokens": 3,
                                                         "grammar": "start: nothing_here"})
    assert bad.status_code == 400
    assert bad.json()["errors"][0]["field"] == "grammar"
    both = httpx.post(f"{worker.base_url}/execute", json={"job_id": "ws-3", "prompt": "x", "max_tokens": 3,
                                                          "grammar": 'start: "a"', "json_schema": {}})
    assert both.status_code == 400


def _call_arguments(call: Any) -> dict[str, Any]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


def test_required_tool_call_parses_and_validates(client: openai.OpenAI, model_id: str) -> None:
    reply = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice="required", max_tokens=400, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert 1 <= len(choice.message.tool_calls) <= MAX_PARALLEL_CALLS
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, parallel_tool_calls=False)
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    _call_arguments(calls[0])


def test_streamed_tool_call_deltas_reassemble_into_the_whole_result(client: openai.OpenAI, model_id: str) -> None:
    kwargs: dict[str, Any] = {"model": model_id, "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                              "max_tokens": 80, "temperature": 0, "parallel_tool_calls": False}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    with client.chat.completions.stream(**kwargs) as stream:  # the client's own assembly of the deltas
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_call_round_trip_through_the_template(client: openai.OpenAI, model_id: str) -> None:
    first = client.chat.completions.create(model=model_id, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=0, parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    final = client.chat.completions.create(model=model_id, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=24, temperature=0).choices[0]
    assert final.message.content and not final.message.tool_calls
    assert "<tool_call>" not in final.message.content
    auto = client.chat.completions.create(model=model_id, messages=history, tools=[WEATHER], max_tokens=60,
                                          temperature=0).choices[0]
    assert auto.message.content or auto.message.tool_calls
    for made in auto.message.tool_calls or []:
        _call_arguments(made)


def test_the_default_tool_convention_renders_calls_and_results_as_turns() -> None:
    template = ChatTemplate(GEMMA, "<bos>", "<eos>", "family:gemma")
    prompt = template.render([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}], tools=[WEATHER])
    assert "get_weather" in prompt.split("Weather?")[0]  # the tool list comes first, in the system text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<start_of_turn>user\n<tool_response>\n21 C\n</tool_response><end_of_turn>" in prompt
    assert prompt.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x"}],
])
def test_the_gemma_family_template_renders_gemma_turns(messages: list[dict[str, str]]) -> None:
    from pathlib import Path

    reference = (Path(__file__).parent / "data" / "gemma_turns.jinja").read_text()
    assert ChatTemplate(GEMMA, "<bos>").render(messages) == ChatTemplate(reference, "<bos>").render(messages)


def test_family_is_chosen_from_architecture_and_vocabulary() -> None:
    assert family_for("gemma3", {"<start_of_turn>": 1, "<end_of_turn>": 2}.__contains__).name == "gemma"
    llama3 = {"<|start_header_id|>": 1, "<|end_header_id|>": 2, "<|eot_id|>": 3}
    assert family_for("llama", llama3.__contains__).name == "llama3"
    assert family_for("qwen2", {"<|im_start|>": 1, "<|im_end|>": 2}.__contains__).name == "chatml"
    assert family_for("llama", {"hello": 1}.__contains__).name == "plain"  # markers the vocabulary lacks are never used


def test_tool_formats_follow_the_template() -> None:
    assert format_for(None, False) is HERMES
    assert format_for("{% for t in tools %}<tool_call>{% endfor %}", True) is HERMES
    assert format_for("{{ tools }}[TOOL_CALLS]", True) is MISTRAL
    assert format_for("{{ tools }}<|python_tag|>", True) is LLAMA3


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_text_splits_into_the_same_content_and_calls_wherever_it_is_cut(cuts: list[int]) -> None:
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris <x>"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    pieces, at = [], 0
    for cut in sorted(c % (len(text) + 1) for c in cuts):
        pieces.append(text[at:cut])
        at = cut
    pieces.append(text[at:])
    parser = ToolCallParser(HERMES)
    content = "".join(parser.feed(piece)[0] for piece in pieces) + parser.finish()[0]
    assert content == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls] == [
        ("get_weather", {"city": "Paris <x>"}), ("get_time", {"zone": "CET"})]


def test_langchain_structured_output_and_bound_tools(worker: Worker, model_id: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model_id, base_url=f"{worker.base_url}/v1", api_key="unused", temperature=0,
                      max_tokens=120, max_retries=0, timeout=180)
    city = chat.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City)

    def get_weather(city: str, unit: str) -> str:
        """The weather in a city now.

        Args:
            city: the city
            unit: celsius or fahrenheit
        """
        return "sunny"

    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert {"city", "unit"} <= set(message.tool_calls[0]["args"])  # the schema allows more keys
