"""The OpenAI API as real clients use it: round trips, tolerated and applied fields, legacy functions,
tool schemas with references, tool calls that end, JSON that ends, and browsers (CORS).

Everything runs against the session's worker on the default model (a base model: where it
cannot be relied on to choose something, the request forces it, and the test says how).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from conftest import Worker
from llorch.api.app import create_app
from llorch.api.cors import parse_origins
from llorch.api.state import WorkerState

HELLO = [{"role": "user", "content": "Hello"}]


def chat(worker: Worker, **body: Any) -> httpx.Response:
    with worker.client() as http:
        return http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8, "temperature": 0, **body})


def end_ids(worker: Worker) -> list[int]:
    """The default model's end-of-generation tokens: <eos> and Gemma's <end_of_turn>."""
    with worker.client() as http:
        ids = http.post("/tokenize", json={"prompt": "<eos><end_of_turn>", "add_special_tokens": False}).json()
    assert len(ids["tokens"]) == 2
    return ids["tokens"]


# -- fields: ignored, applied, refused ------------------------------------------------------------

def test_fields_that_cannot_change_the_output_are_accepted_and_change_nothing(worker: Worker, model_id: str) -> None:
    plain = chat(worker, model=model_id).json()["choices"][0]["message"]["content"]
    ignored = {"store": True, "metadata": {"team": "x"}, "service_tier": "auto", "prompt_cache_key": "k",
               "reasoning_effort": "low", "verbosity": "low", "user": "u", "safety_identifier": "s",
               "modalities": ["text"], "top_logprobs": None, "response_format": None, "tools": None}
    answer = chat(worker, model=model_id, **ignored)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == plain


def test_a_body_without_model_is_served_by_the_loaded_model(worker: Worker, model_id: str) -> None:
    answer = chat(worker)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == model_id


def test_models_retrieve_names_the_served_model_and_404s_others(client: openai.OpenAI, model_id: str) -> None:
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_an_answer_sent_back_as_model_dump_continues_the_conversation(client: openai.OpenAI, model_id: str) -> None:
    first = client.chat.completions.create(model=model_id, messages=HELLO, max_tokens=8, temperature=0)
    sent_back = first.choices[0].message.model_dump()  # refusal, annotations, audio, function_call: all None
    assert {"refusal", "annotations", "audio", "function_call"} <= sent_back.keys()
    sent_back["refusal"], sent_back["annotations"] = "", []  # what other providers fill in
    second = client.chat.completions.create(model=model_id, max_tokens=4, temperature=0,
                                            messages=[*HELLO, sent_back, {"role": "user", "content": "More"}])
    assert second.choices[0].message.content


def test_litellm_sends_its_message_back(worker: Worker, model_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    import litellm

    settings = {"model": f"openai/{model_id}", "api_base": f"{worker.base_url}/v1", "api_key": "unused",
                "max_tokens": 6, "temperature": 0}
    first = litellm.completion(messages=HELLO, **settings)
    message = first.choices[0].message
    message.provider_specific_fields = {"note": "kept by the client"}
    second = litellm.completion(messages=[*HELLO, message, {"role": "user", "content": "More"}], **settings)
    assert second.choices[0].message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"web_search_options": {}}, "web_search_options"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a1"}}, *HELLO]}, "messages.0.audio"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"min_tokens": 4, "response_format": {"type": "json_object"}}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"function_call": "auto"}, None),
])
def test_fields_that_would_change_the_output_unsupported_are_400s_naming_them(
        worker: Worker, body: dict[str, Any], param: str | None) -> None:
    answer = chat(worker, **body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    if param is None:  # a check across fields: the message names them
        assert "function_call" in error["message"]
    else:
        assert (error["param"] or "").startswith(param) and param in error["message"]


def test_min_tokens_holds_off_the_end_and_ignore_eos_runs_to_max_tokens(worker: Worker) -> None:
    # A bias on the end tokens makes the model end at once: the floor under it is all that can hold it off.
    bias = {str(i): 100 for i in end_ids(worker)}
    at_once = chat(worker, logit_bias=bias, max_tokens=12).json()
    assert at_once["choices"][0]["finish_reason"] == "stop" and at_once["usage"]["completion_tokens"] == 0
    floor = chat(worker, logit_bias=bias, max_tokens=12, min_tokens=5).json()
    assert floor["choices"][0]["finish_reason"] == "stop" and floor["usage"]["completion_tokens"] == 5
    never = chat(worker, logit_bias=bias, max_tokens=12, ignore_eos=True).json()
    assert never["choices"][0]["finish_reason"] == "length" and never["usage"]["completion_tokens"] == 12


def test_continue_final_message_continues_the_assistant_text(worker: Worker, client: openai.OpenAI,
                                                             model_id: str) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "Hi! My name is"}]
    continued = chat(worker, messages=messages, add_generation_prompt=False, continue_final_message=True).json()
    # The same prompt by hand: the conversation rendered without a generation prompt, cut before the
    # end-of-turn token that closes the final message, as token ids.
    with worker.client() as http:
        rendered = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                "return_token_strs": True}).json()
    cut = len(rendered["token_strs"]) - rendered["token_strs"][::-1].index("<end_of_turn>") - 1
    by_hand = client.completions.create(model=model_id, prompt=rendered["tokens"][:cut], max_tokens=8, temperature=0)
    assert continued["choices"][0]["message"]["content"] == by_hand.choices[0].text
    assert continued["usage"]["prompt_tokens"] == cut
    refused = chat(worker, messages=HELLO, add_generation_prompt=False, continue_final_message=True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


# -- tools ---------------------------------------------------------------------------------------

class Item(BaseModel):
    name: str = Field(max_length=16)
    quantity: int = Field(ge=1, le=9)


class Order(BaseModel):
    customer: str = Field(max_length=16)
    items: list[Item] = Field(min_length=1, max_length=2)


RECURSIVE = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8},
                                              "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}},
             "required": ["label", "children"], "additionalProperties": False}


def test_tool_schemas_with_definitions_are_followed(client: openai.OpenAI, model_id: str) -> None:
    tool = openai.pydantic_function_tool(Order, name="place_order")
    schema = tool["function"]["parameters"]
    assert "$defs" in schema  # the nested model is a reference
    answer = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Alice wants two apples."}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": "place_order"}}, max_tokens=120, temperature=0)
    call = answer.choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert answer.choices[0].finish_reason == "tool_calls"


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, for checking what a grammar admits, byte by byte."""

    def __init__(self) -> None:
        self.tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
        self.eos_token_id = self.bos_token_id = 256
        self.special_token_ids = [256]

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


def admits(grammar: str, text: str) -> bool:
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    matcher = LLMatcher(LLTokenizer(TokenizerWrapper(_Bytes())), LLMatcher.grammar_from_lark(grammar), log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def test_a_recursive_tool_schema_constrains_every_level() -> None:
    from llorch.api.tool_calls import HERMES
    from llorch.api.tool_calls import grammar as tool_grammar

    tools = [{"type": "function", "function": {"name": "make_tree", "parameters": RECURSIVE}},
             openai.pydantic_function_tool(Order, name="place_order")]
    grammar = tool_grammar(HERMES, tools, "required", True, {})
    tree = {"label": "a", "children": [{"label": "b", "children": []}]}
    order = {"customer": "Alice", "items": [{"name": "apple", "quantity": 2}]}

    def call(name: str, arguments: Any) -> str:
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'

    assert admits(grammar, call("make_tree", tree))
    assert admits(grammar, call("make_tree", tree) + "\n" + call("place_order", order))
    assert not admits(grammar, call("make_tree", {"label": "a", "children": [{"children": []}]}))  # a child's label
    assert not admits(grammar, call("place_order", {**order, "items": [{"name": "apple", "quantity": 0}]}))


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_parallel_tool_calls_end_the_turn_with_its_calls_and_no_marker_text(client: openai.OpenAI,
                                                                            model_id: str) -> None:
    # The default model, free to make several calls, repeats its call: the repeat ends the turn.
    answer = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=200, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content and choice.message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(set(calls)) == len(calls)
    assert answer.usage.completion_tokens < 200
    # The stream helper, which raises on a length finish, assembles the same calls.
    with client.chat.completions.stream(model=model_id, tools=[WEATHER], tool_choice="required", max_tokens=200,
                                        temperature=0, messages=[{"role": "user",
                                                                  "content": "What is the weather in Paris?"}]) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == calls


def test_auto_tool_choice_may_answer_in_text_without_call_markers(client: openai.OpenAI, model_id: str) -> None:
    answer = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Tell me a joke about cats."}], tools=[WEATHER],
        tool_choice="auto", max_tokens=24, temperature=0)
    message = answer.choices[0].message
    assert message.content and not message.tool_calls  # the default model answers this one in text
    assert "<tool_call>" not in message.content  # text can never hold the call marker


def test_legacy_functions_are_answered_with_a_function_call(worker: Worker) -> None:
    functions = [{"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    answer = chat(worker, functions=functions, function_call={"name": "get_weather"}, max_tokens=40,
                  messages=[{"role": "user", "content": "Weather in Paris?"}]).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    jsonschema.validate(json.loads(choice["message"]["function_call"]["arguments"]), functions[0]["parameters"])
    # The call and its answer go back the legacy way.
    history = [{"role": "user", "content": "Weather in Paris?"}, choice["message"],
               {"role": "function", "name": "get_weather", "content": "sunny"}]
    assert chat(worker, functions=functions, messages=history).status_code == 200


# -- JSON that ends ------------------------------------------------------------------------------

class City(BaseModel):
    name: str
    population_millions: float
    is_capital: bool


def test_parse_with_a_number_field_finishes(client: openai.OpenAI, model_id: str) -> None:
    answer = client.chat.completions.parse(model=model_id, response_format=City, max_tokens=200, temperature=0,
                                           messages=[{"role": "user", "content": "Describe Paris."}])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.parsed is not None
    assert abs(answer.choices[0].message.parsed.population_millions) < 1e16


def test_json_object_mode_closes_its_document(client: openai.OpenAI, model_id: str) -> None:
    # Left to itself the default model nests {"items": {"items": ... without end; open values are bounded.
    answer = client.chat.completions.create(
        model=model_id, response_format={"type": "json_object"}, max_tokens=400, temperature=0,
        messages=[{"role": "system", "content": f"Answer in JSON matching {json.dumps(Order.model_json_schema())}"},
                  {"role": "user", "content": "Alice ordered two apples and a pear."}])
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_instructor_tools_and_json_schema_modes_with_nested_models(worker: Worker, model_id: str) -> None:
    import instructor

    base = openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="unused", max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        order = instructor.from_openai(base, mode=mode).chat.completions.create(
            model=model_id, response_model=Order, max_retries=0, max_tokens=200, temperature=0,
            messages=[{"role": "user", "content": "Alice ordered two apples and a pear."}])
        assert isinstance(order, Order) and order.items


def test_langchain_json_mode_finishes(worker: Worker, model_id: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{worker.base_url}/v1", api_key="unused", model=model_id, temperature=0,
                     max_tokens=200)
    answer = llm.with_structured_output(None, method="json_mode", include_raw=True).invoke(
        "Return the capital of France as JSON with the key capital.")
    assert answer["raw"].response_metadata["finish_reason"] == "stop"
    assert isinstance(answer["parsed"], dict)


def test_a_pydantic_ai_agent_with_a_tool_and_structured_output_finishes(worker: Worker, model_id: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Place(BaseModel):
        city: str = Field(max_length=30)
        country: str = Field(max_length=30)

    model = OpenAIChatModel(model_id, provider=OpenAIProvider(base_url=f"{worker.base_url}/v1", api_key="unused"))
    agent = Agent(model, output_type=Place, model_settings={"temperature": 0, "max_tokens": 120})
    looked_up: list[str] = []

    @agent.tool_plain
    def lookup(city: str) -> str:
        """Facts about a city."""
        looked_up.append(city)
        return f"{city} is in France."

    result = agent.run_sync("Where is Paris? Use the lookup tool.")  # the default request limit applies
    assert isinstance(result.output, Place)
    assert result.usage.requests <= 50


# -- browsers ------------------------------------------------------------------------------------

def cors_client(origins: str | None, api_key: str | None = "k") -> TestClient:
    return TestClient(create_app(WorkerState(backend="cpu", device="cpu"), api_key, parse_origins(origins)))


def preflight(client: TestClient, origin: str) -> httpx.Response:
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_pages_on_localhost_may_call_by_default_and_others_may_not() -> None:
    client = cors_client(None)
    for origin in ("http://localhost:3000", "https://127.0.0.1", "http://[::1]:8000"):
        answer = preflight(client, origin)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    refused = preflight(client, "https://example.com")
    assert "access-control-allow-origin" not in refused.headers
    # The key is still required, and the refusal is readable by the page.
    unauthorised = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert unauthorised.status_code == 401
    assert unauthorised.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_cors_origins_flag_names_origins_allows_any_or_none() -> None:
    named = cors_client("https://app.example")
    assert preflight(named, "https://app.example").headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in preflight(named, "http://localhost:3000").headers
    assert preflight(cors_client("*"), "https://anywhere.example").headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in preflight(cors_client("none"), "http://localhost:3000").headers
    with pytest.raises(ValueError, match="http"):
        parse_origins("example.com")
