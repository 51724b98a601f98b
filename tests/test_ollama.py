"""Ollama's API (/api/*) through the official `ollama` client, against the default model."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest

from conftest import Worker
from llorch.api.ollama_answer import Reply
from llorch.api.reasoning import ReasoningParser
from llorch.api.tool_calls import HERMES, ToolCallParser
from llorch.api.turn import Turn

pytestmark = pytest.mark.cpu

ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def olla(worker: Worker) -> ollama.Client:
    return ollama.Client(host=worker.base_url, timeout=180)


def greedy(num_predict: int, **more: Any) -> dict[str, Any]:
    return {"temperature": 0, "num_predict": num_predict, **more}


def test_chat_matches_the_openai_api_greedy(olla: ollama.Client, client: openai.OpenAI, model_id: str) -> None:
    reply = olla.chat(model=model_id, messages=ASK, options=greedy(16), stream=False)
    reference = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=16, temperature=0)
    assert reply.message.role == "assistant"
    assert reply.message.content == reference.choices[0].message.content
    assert reply.eval_count == reference.usage.completion_tokens
    assert reply.prompt_eval_count == reference.usage.prompt_tokens
    assert reply.done is True
    assert reply.done_reason == "length"  # a base model does not stop within 16 tokens here
    assert reply.model == model_id
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0


def test_streamed_chat_concatenates_to_the_same_text(olla: ollama.Client, model_id: str) -> None:
    whole = olla.chat(model=model_id, messages=ASK, options=greedy(16), stream=False)
    parts = list(olla.chat(model=f"{model_id}:latest", messages=ASK, options=greedy(16), stream=True))
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert all(not p.done for p in parts[:-1])
    last = parts[-1]
    assert last.done is True and last.done_reason == "length"
    assert last.eval_count == whole.eval_count == 16
    assert last.total_duration and last.eval_duration and last.prompt_eval_count == whole.prompt_eval_count


@pytest.mark.parametrize("stream", [False, True])
def test_generate_stops_at_num_predict_or_a_stop_sequence(olla: ollama.Client, model_id: str, stream: bool) -> None:
    def run(**options: Any) -> tuple[str, Any]:
        answer = olla.generate(model=model_id, prompt="The capital of France is", raw=True,
                               options=greedy(12, **options), stream=stream)
        if not stream:
            return answer.response, answer
        parts = list(answer)
        return "".join(p.response or "" for p in parts), parts[-1]

    text, last = run()
    assert last.done and last.done_reason == "length" and last.eval_count == 12
    cut = text.strip().split(" ")[1]  # a word inside the greedy text: it must stop before it
    stopped, last_stopped = run(stop=[cut])
    assert last_stopped.done and last_stopped.done_reason == "stop"
    assert cut not in stopped and text.startswith(stopped)
    assert last_stopped.eval_count < 12


def test_generate_without_raw_is_one_user_turn_of_the_chat(olla: ollama.Client, model_id: str) -> None:
    chat = olla.chat(model=model_id, messages=[{"role": "system", "content": "Be brief."}, *ASK],
                     options=greedy(10), stream=False)
    generated = olla.generate(model=model_id, system="Be brief.", prompt=ASK[0]["content"], options=greedy(10))
    assert generated.response == chat.message.content
    assert generated.prompt_eval_count == chat.prompt_eval_count


def test_an_empty_prompt_or_chat_only_loads_the_model(olla: ollama.Client, model_id: str) -> None:
    assert olla.generate(model=model_id, prompt="").done_reason == "load"
    loaded = olla.chat(model=model_id, messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""


def test_a_json_schema_format_gives_valid_json(olla: ollama.Client, model_id: str) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = olla.chat(model=model_id, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                      format=schema, options=greedy(60), stream=False)
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), schema)
    plain = olla.generate(model=model_id, prompt="A JSON object:", format="json", options=greedy(40))
    if plain.done_reason == "stop":
        assert isinstance(json.loads(plain.response), dict)


def few_shot_weather(city: str, weather: str) -> list[dict[str, Any]]:
    """An earlier exchange that called the tool: the base model follows such examples (verified greedy)."""
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": weather.lower(), "tool_name": "get_weather"},
            {"role": "assistant", "content": f"{weather}."}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(olla: ollama.Client, client: openai.OpenAI, model_id: str, stream: bool) -> None:
    history = [*few_shot_weather("Rome", "Sunny"), *few_shot_weather("Berlin", "Rain"),
               {"role": "user", "content": "What is the weather in Paris?"}]
    answer = olla.chat(model=model_id, messages=history, tools=[WEATHER], options=greedy(40), stream=stream)
    if stream:
        parts = list(answer)
        calls = [c for p in parts for c in p.message.tool_calls or []]
        assert parts[-1].done
    else:
        calls = list(answer.message.tool_calls or [])
    assert calls, "the few-shot history makes the default model call the tool"
    for call in calls:  # the grammar keeps every call to the tool's schema
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
    assert calls[0].function.arguments["city"] == "Paris"
    # The call and its result go back; the answer is the one the OpenAI API gives the same conversation.
    history += [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": c.function.name, "arguments": dict(c.function.arguments)}} for c in calls[:1]]},
        {"role": "tool", "content": "rain", "tool_name": "get_weather"}]
    final = olla.chat(model=model_id, messages=history, options=greedy(12), stream=False)
    reference = client.chat.completions.create(model=model_id, max_tokens=12, temperature=0, messages=openai_shape(
        history))
    assert final.message.content == reference.choices[0].message.content
    assert final.prompt_eval_count == reference.usage.prompt_tokens


def openai_shape(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation in OpenAI's shape: calls with ids and JSON-text arguments, results naming them."""
    shaped, last_ids = [], []
    for message in messages:
        if message.get("tool_calls"):
            last_ids = [f"call_{i}" for i in range(len(message["tool_calls"]))]
            shaped.append({"role": "assistant", "content": message["content"] or None, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": c["function"]["name"],
                                                           "arguments": json.dumps(c["function"]["arguments"])}}
                for i, c in zip(last_ids, message["tool_calls"], strict=True)]})
        elif message["role"] == "tool":
            shaped.append({"role": "tool", "content": message["content"], "tool_call_id": last_ids[0]})
        else:
            shaped.append(message)
    return shaped


def test_model_listing_parses_in_the_clients_types(olla: ollama.Client, worker: Worker, model_id: str) -> None:
    listed = olla.list().models
    assert [m.model for m in listed] == [f"{model_id}:latest"]
    entry = listed[0]
    assert entry.size > 100_000_000 and re.fullmatch(r"[0-9a-f]{64}", entry.digest)
    assert entry.details.format == "gguf" and entry.details.family == "gemma3"
    assert entry.details.quantization_level == "Q4_K_M" and entry.details.parameter_size.endswith("M")
    shown = olla.show(model_id)
    assert shown.capabilities == ["completion", "tools"]
    assert "<start_of_turn>" in shown.template
    assert shown.modelinfo["gemma3.context_length"] == 32768
    assert shown.details.family == "gemma3"
    running = olla.ps().models
    assert [m.model for m in running] == [f"{model_id}:latest"]
    assert running[0].size > entry.size and running[0].context_length > 0
    version = httpx.get(f"{worker.base_url}/api/version").json()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version["version"])


def test_unknown_models_and_bad_requests_answer_in_ollamas_error_shape(olla: ollama.Client, worker: Worker,
                                                                      model_id: str) -> None:
    for call in (lambda: olla.chat(model="llama3", messages=ASK), lambda: olla.show("llama3:latest"),
                 lambda: olla.generate(model=f"{model_id}:7b", prompt="Hi")):
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == 404 and "not found" in caught.value.error
    cases = {"suffix": {"prompt": "def f(", "suffix": "return 1"}, "context": {"prompt": "Hi", "context": [1, 2]},
             "template": {"prompt": "Hi", "template": "{{ .Prompt }}"}, "mirostat": {"prompt": "Hi",
                                                                                   "options": {"mirostat": 2}},
             "temperature": {"prompt": "Hi", "options": {"temperature": 5}}, "images": {"prompt": "Hi",
                                                                                        "images": ["aGk="]}}
    for name, body in cases.items():
        answer = httpx.post(f"{worker.base_url}/api/generate", json={"model": model_id, "stream": False, **body})
        assert answer.status_code == 400, answer.text
        assert name in answer.json()["error"]
    # The runner's own settings cannot change the answer: accepted and ignored.
    ignored = olla.generate(model=model_id, prompt="Hi", raw=True, keep_alive="5m",
                            options=greedy(4, num_ctx=2048, num_thread=1, num_gpu=0))
    assert ignored.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as thinking:
        olla.chat(model=model_id, messages=ASK, think=True)
    assert thinking.value.status_code == 400 and "thinking" in thinking.value.error


def cancelled_jobs(worker: Worker) -> float:
    text = httpx.get(f"{worker.base_url}/metrics").text
    found = re.search(r'^llorch_requests_total\{outcome="cancelled"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_its_job(worker: Worker, model_id: str, stream: bool) -> None:
    before = cancelled_jobs(worker)
    # Greedy: Ollama's default draws at temperature 0.8 unseeded, and a draw of the end token early enough
    # ended the job before the client left (a flake seen once)
    body = {"model": model_id, "prompt": "Once upon a time", "raw": True, "stream": stream,
            "options": {"num_predict": 4000, "temperature": 0}}
    if stream:
        with httpx.stream("POST", f"{worker.base_url}/api/generate", json=body, timeout=60) as answer:
            first = json.loads(next(answer.iter_lines()))
            assert first["done"] is False
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{worker.base_url}/api/generate", json=body, timeout=1.5)
    deadline = time.monotonic() + 30
    while cancelled_jobs(worker) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cancelled_jobs(worker) == before + 1


def test_thoughts_content_and_calls_are_split_as_they_stream() -> None:
    reply = Reply(Turn(ReasoningParser.for_prompt(("<think>", "</think>"), "<start>model\n"), ToolCallParser(HERMES)))
    text = '<think>It rains?</think>Let me check.<tool_call>\n{"name": "w", "arguments": {"c": "Paris"}}\n</tool_call>'
    pieces = [reply.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [reply.finish()]
    assert "".join(p.reasoning for p in pieces) == "It rains?"
    assert "".join(p.content for p in pieces) == "Let me check."
    calls = [c for p in pieces for c in p.calls]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("w", {"c": "Paris"})]
    assert reply.whole.reasoning == "It rains?" and reply.whole.calls == calls
