"""llama-server's API as its clients use it: /completion (whole and streamed), /tokenize and /detokenize in its
shapes, /apply-template, /props, /slots, and the OpenAI routes without /v1 (the official client on a base URL
without it). Values are checked against llorch's own routes on the same worker.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from conftest import Worker, start_worker, stop_worker
from llorch import __version__
from llorch.api.app import create_app
from llorch.api.errors import family_of
from llorch.api.state import WorkerState
from soak import scrape

pytestmark = pytest.mark.cpu

PROMPT = "The capital of France is"
LONG_RUNNING = "List the numbers from 1 to 500: 1, 2, 3,"  # greedy never ends it before max_tokens
HELLO = [{"role": "user", "content": "Hello"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker on the default model with llama-server's /slots turned on."""
    live = start_worker(tmp_path_factory.mktemp("llama"), "--slots")
    yield live
    stop_worker(live)


@pytest.fixture(scope="module")
def http(llama: Worker) -> Iterator[httpx.Client]:
    with llama.client() as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    answer = http.post("/completion", json={"prompt": PROMPT, **GREEDY, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()


def v1_completion(http: httpx.Client, model: str, max_tokens: int, **body: Any) -> dict[str, Any]:
    answer = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens,
                                                **GREEDY, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def own_tokens(http: httpx.Client, **body: Any) -> list[int]:
    return http.post("/tokenize", json=body).json()["tokens"]


def llama_error(answer: httpx.Response, status: int, kind: str, *fragments: str) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == status and error["type"] == kind
    for fragment in fragments:
        assert fragment in error["message"]


def stream(http: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    """A streamed /completion read as llama-server's clients read it: every `data:` line is one JSON object."""
    chunks = []
    with http.stream("POST", "/completion", json={"prompt": PROMPT, **GREEDY, **body, "stream": True}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line:
                assert line.startswith("data: ") and line != "data: [DONE]"
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


# -- /completion ----------------------------------------------------------------------------------------------

def test_greedy_completion_is_the_v1_completion_with_llama_servers_fields(http: httpx.Client, model_id: str) -> None:
    answer = complete(http, n_predict=12, return_tokens=True)
    assert answer["content"] == v1_completion(http, model_id, 12)["text"]
    assert answer["stop"] is True and answer["stop_type"] == "limit" and answer["stopping_word"] == ""
    assert answer["tokens_predicted"] == len(answer["tokens"]) == 12
    assert answer["tokens_evaluated"] == len(own_tokens(http, prompt=PROMPT))
    assert http.post("/detokenize", json={"tokens": answer["tokens"]}).json()["content"] == answer["content"]
    assert answer["model"] == model_id and answer["truncated"] is False and answer["index"] == 0
    settings = answer["generation_settings"]
    assert settings["n_predict"] == 12 and settings["temperature"] == 0 and settings["n_ctx"] > 0
    assert isinstance(settings["seed"], int) and settings["seed"] >= 0  # the seed drawn for seed -1
    timings = answer["timings"]
    assert timings["prompt_n"] == answer["tokens_evaluated"] and timings["predicted_n"] == 12
    assert timings["predicted_ms"] > 0 and timings["prompt_ms"] > 0
    assert timings["predicted_per_second"] == pytest.approx(12_000 / timings["predicted_ms"])


def test_a_stop_word_ends_the_completion_before_it(http: httpx.Client) -> None:
    whole = complete(http, n_predict=12)["content"]
    word = whole.split()[2]
    answer = complete(http, n_predict=12, stop=[f" {word}"])
    assert answer["stop_type"] == "word" and answer["stopping_word"] == f" {word}"
    assert answer["content"] == whole[: whole.index(f" {word}")]


def test_logit_bias_false_bans_a_token_and_response_fields_pick_fields(http: httpx.Client) -> None:
    first = complete(http, n_predict=1, return_tokens=True)["tokens"][0]
    banned = complete(http, n_predict=1, return_tokens=True, logit_bias=[[first, False]])["tokens"][0]
    assert banned != first
    as_object = complete(http, n_predict=1, return_tokens=True, logit_bias={str(first): -100})  # OpenAI's form
    assert as_object["tokens"][0] != first
    picked = complete(http, n_predict=2, response_fields=["content", "generation_settings/n_predict", "nothing"])
    assert set(picked) == {"content", "generation_settings/n_predict"} and picked["generation_settings/n_predict"] == 2


def test_n_predict_zero_reads_the_prompt_only_and_seeds_repeat(http: httpx.Client) -> None:
    nothing = complete(http, n_predict=0)
    assert nothing["content"] == "" and nothing["tokens_predicted"] == 0 and nothing["stop_type"] == "limit"
    sampled = [complete(http, n_predict=8, temperature=1.0, seed=7)["content"] for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert complete(http, n_predict=8, temperature=1.0, seed=7)["generation_settings"]["seed"] == 7


def test_n_probs_are_sorted_log_probabilities_matching_the_openai_route(http: httpx.Client, model_id: str) -> None:
    answer = complete(http, n_predict=5, n_probs=3, return_tokens=True)
    theirs = v1_completion(http, model_id, 5, logprobs=3)["logprobs"]
    probabilities = answer["completion_probabilities"]
    assert [p["id"] for p in probabilities] == answer["tokens"]
    assert [p["token"] for p in probabilities] == theirs["tokens"]
    for ours, logprob, top in zip(probabilities, theirs["token_logprobs"], theirs["top_logprobs"], strict=True):
        assert ours["logprob"] == pytest.approx(logprob, abs=1e-5)
        values = [t["logprob"] for t in ours["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert ours["top_logprobs"][0]["id"] == ours["id"]  # greedy: the chosen token is the likeliest
        assert {t["token"]: t["logprob"] for t in ours["top_logprobs"]} == pytest.approx(top, abs=1e-5)
        assert bytes(ours["bytes"]).decode() == ours["token"]


def test_a_streamed_completion_reassembles_to_the_whole_one(http: httpx.Client) -> None:
    whole = complete(http, n_predict=10, return_tokens=True)
    chunks = stream(http, n_predict=10)
    *partial, last = chunks
    assert partial and all(c["stop"] is False and c["index"] == 0 and "id_slot" in c for c in partial)
    assert "".join(c["content"] for c in partial) == whole["content"]
    assert [t for c in partial for t in c["tokens"]] == whole["tokens"]
    assert last["stop"] is True and last["stop_type"] == "limit" and last["tokens_predicted"] == 10
    assert last["content"] == "" and last["timings"]["predicted_n"] == 10 and last["generation_settings"]["stream"]


def test_prompts_as_token_ids_or_mixed_with_text(http: httpx.Client, model_id: str) -> None:
    head = own_tokens(http, prompt="The capital", add_special_tokens=False)
    tail = own_tokens(http, prompt=" of France is", add_special_tokens=False)
    expected = v1_completion(http, model_id, 8, prompt=head + tail)["text"]
    assert complete(http, prompt=head + tail, n_predict=8)["content"] == expected
    mixed = complete(http, prompt=[*head, " of France is"], n_predict=8)
    assert mixed["content"] == expected and mixed["tokens_evaluated"] == len(head) + len(tail) + 1  # + BOS
    llama_error(http.post("/completion", json={"prompt": ["one", "two"]}), 400, "invalid_request_error",
                "prompt", "several prompts")


def test_gbnf_grammar_and_json_schema_constrain_the_output(http: httpx.Client) -> None:
    answer = complete(http, prompt="Is Paris in France? Answer:", n_predict=8, grammar='root ::= " yes" | " no"')
    assert answer["content"] in (" yes", " no") and answer["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    parsed = json.loads(complete(http, prompt="JSON:", n_predict=40, json_schema=schema)["content"])
    assert isinstance(parsed["city"], str)
    llama_error(http.post("/completion", json={"prompt": "x", "grammar": "root ::= missing"}), 400,
                "invalid_request_error", "grammar")


def test_fields_that_cannot_change_the_output_are_accepted(http: httpx.Client) -> None:
    plain = complete(http, n_predict=8)["content"]
    ignored = {"cache_prompt": False, "id_slot": 2, "n_keep": 16, "model": "any", "samplers": "edskypmxt",
               "mirostat_tau": 4.0, "dry_base": 2.0, "xtc_threshold": 0.2, "repeat_last_n": 64, "typical_p": 1.0,
               "dynatemp_range": 0.0, "n_probs": None}
    assert complete(http, n_predict=8, **ignored)["content"] == plain


@pytest.mark.parametrize(("field", "value"), [
    ("mirostat", 2), ("typical_p", 0.5), ("dry_multiplier", 0.8), ("xtc_probability", 0.5), ("n_cmpl", 2),
    ("dynatemp_range", 0.5), ("post_sampling_probs", True), ("samplers", ["top_p", "top_k"]),
    ("repeat_penalty", 1.1), ("logit_bias", [["hello", 1.0]]), ("unknown_field", 1)])
def test_unsupported_parameters_are_400s_naming_them(http: httpx.Client, field: str, value: Any) -> None:
    named = "repeat_last_n" if field == "repeat_penalty" else field
    llama_error(http.post("/completion", json={"prompt": "x", field: value}), 400, "invalid_request_error", named)


def test_a_client_leaving_a_streamed_completion_cancels_its_job(llama: Worker, http: httpx.Client) -> None:
    body = {"prompt": LONG_RUNNING, "n_predict": 2048, "stream": True, **GREEDY}
    with http.stream("POST", "/completion", json=body) as answer:
        lines = answer.iter_lines()
        next(line for line in lines if line.startswith("data: "))
    assert idle(llama)
    generated = scrape(llama.base_url)["llorch_generated_tokens_total"]
    time.sleep(0.5)  # nothing goes on generating
    assert scrape(llama.base_url)["llorch_generated_tokens_total"] == generated
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the worker notices the client leaving too
        httpx.post(f"{llama.base_url}/completion", json={**body, "stream": False}, timeout=httpx.Timeout(30, read=1))
    assert idle(llama)


def idle(worker: Worker) -> bool:
    """True once no job holds KV blocks."""
    deadline = time.monotonic() + 10
    while scrape(worker.base_url)["llorch_kv_cache_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return not scrape(worker.base_url)["llorch_kv_cache_bytes"]


# -- /tokenize, /detokenize, /apply-template ------------------------------------------------------------------

def test_tokenize_in_llama_servers_shape(http: httpx.Client) -> None:
    text = "Hello wörld ᚠ 🎉"  # the rune is three byte-fallback tokens, each no character on its own
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == own_tokens(http, prompt=text, add_special_tokens=False)
    assert any(isinstance(p["piece"], list) for p in pieces)
    spelled = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert spelled.decode() == text
    plain = http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert plain == own_tokens(http, prompt=text)  # BOS first, as llorch's own adds it
    assert http.post("/detokenize", json={"tokens": plain}).json()["content"] == text
    llama_error(http.post("/tokenize", json={"content": text, "prompt": text}), 400, "invalid_request_error",
                "prompt")


def test_apply_template_renders_what_tokenize_reads_for_messages(http: httpx.Client) -> None:
    prompt = http.post("/apply-template", json={"messages": HELLO}).json()["prompt"]
    assert prompt.endswith("model\n")
    assert own_tokens(http, prompt=prompt, add_special_tokens=False) == own_tokens(http, messages=HELLO)
    llama_error(http.post("/apply-template", json={"messages": []}), 400, "invalid_request_error", "messages")


# -- /props, /slots ----------------------------------------------------------------------------------------

def test_props_describe_the_served_model(http: httpx.Client) -> None:
    props = http.get("/props").json()
    info = http.get("/tokenizer_info").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == info["model_max_length"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert settings["params"]["n_predict"] == -1 and settings["params"]["seed"] == -1
    assert props["total_slots"] == 16  # --max-running's default
    assert props["chat_template"] == (info["chat_template"] or "") and props["bos_token"] == info["bos_token"]
    assert props["model_path"].endswith(".gguf") and __version__ in props["build_info"]
    assert props["modalities"] == {"vision": False, "audio": False}


def test_slots_show_a_job_while_it_runs(llama: Worker, http: httpx.Client) -> None:
    body = {"job_id": "seen-in-slots", "prompt": LONG_RUNNING, "max_tokens": 2048, "temperature": 0}
    with http.stream("POST", "/execute", json=body) as answer:
        lines = answer.iter_lines()
        next(line for line in lines if '"type":"token"' in line)
        slot = next(s for s in http.get("/slots").json() if s["id_task"] == "seen-in-slots")
        http.post("/cancel", json={"job_id": "seen-in-slots"})
        list(lines)
    assert slot["is_processing"] is True and slot["prompt"] == LONG_RUNNING and slot["n_prompt_tokens"] > 10
    assert slot["next_token"][0]["n_decoded"] >= 1 and slot["n_ctx"] > 0
    assert idle(llama)
    assert http.get("/slots").json() == []


def test_slots_are_off_without_the_flag_and_errors_take_llama_servers_shape() -> None:
    with TestClient(create_app(WorkerState("cpu", "cpu"))) as loading:
        llama_error(loading.get("/slots"), 501, "not_supported_error", "--slots")
        llama_error(loading.post("/completion", json={"prompt": "x"}), 503, "unavailable_error", "loading")
        llama_error(loading.get("/props"), 503, "unavailable_error")
        llama_error(loading.post("/props"), 405, "invalid_request_error")
        llama_error(loading.post("/completion", content=b"{"), 400, "invalid_request_error", "JSON")
        assert "/slots" not in loading.get("/openapi.json").json()["paths"]  # documented only when served
    with TestClient(create_app(WorkerState("cpu", "cpu"), api_key="k", slots=True)) as served:
        llama_error(served.get("/props"), 401, "authentication_error", "API key")
        served.headers["Authorization"] = "Bearer k"
        llama_error(served.get("/slots"), 503, "unavailable_error", "loading")
        schema = served.get("/openapi.json").json()
    for path in ("/completion", "/props", "/slots", "/apply-template"):
        assert path in schema["paths"]
    body = schema["paths"]["/completion"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/LlamaCompletionRequest"}
    assert "n_predict" in schema["components"]["schemas"]["LlamaCompletionRequest"]["properties"]
    assert "/chat/completions" not in schema["paths"]  # the aliases stay out of the document


# -- the OpenAI routes without /v1 ------------------------------------------------------------------------

def test_every_openai_route_is_served_without_v1_in_openai_shape() -> None:
    """Each /v1 route of the document (Anthropic's aside) answers at the root too, as it does under /v1."""
    with TestClient(create_app(WorkerState("cpu", "cpu"))) as loading:
        paths = loading.get("/openapi.json").json()["paths"]
        routes = [(path.removeprefix("/v1"), method) for path, methods in paths.items() for method in methods
                  if path.startswith("/v1/") and not path.startswith("/v1/messages")]
        assert {"/chat/completions", "/completions", "/models", "/responses"} <= {path for path, _ in routes}
        for path, method in routes:
            concrete = re.sub(r"{[^}]+}", "x", path)
            answer = loading.request(method.upper(), concrete, json={})
            # The same answer as under /v1 (a routing 404 would name the path it was asked for).
            assert answer.json() == loading.request(method.upper(), f"/v1{concrete}", json={}).json()
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
            assert family_of(concrete) == "openai"
        assert family_of("/messages") == "worker"  # Anthropic's route has no alias


def test_the_openai_client_without_v1(llama: Worker, http: httpx.Client, model_id: str) -> None:
    bare = openai.OpenAI(base_url=llama.base_url, api_key="unused", max_retries=0, timeout=120)
    assert bare.models.list().data[0].id == model_id
    text = bare.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert text == v1_completion(http, model_id, 8)["text"]
    streamed = bare.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text
    chat = bare.chat.completions.create(model=model_id, messages=HELLO, max_tokens=6, temperature=0)
    parts = bare.chat.completions.create(model=model_id, messages=HELLO, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == chat.choices[0].message.content
    without_model = http.post("/chat/completions", json={"messages": HELLO, "max_tokens": 6, **GREEDY})
    assert without_model.json()["choices"][0]["message"]["content"] == chat.choices[0].message.content
    refused = http.post("/completions", json={"prompt": "x", "temperature": 5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        bare.models.retrieve("no-such-model")
