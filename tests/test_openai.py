"""The OpenAI-compatible API, driven by the official `openai` client against real workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from conftest import Reference, Worker, all_logits, greedy_ids, start_worker, stop_worker
from llorch.weights.chat_template import ChatTemplate, ChatTemplateError
from llorch.weights.loader import LoadedModel

pytestmark = pytest.mark.cpu

API_KEY = "test-key-1234"
TEMPLATE_PATH = Path(__file__).parent / "data" / "gemma_turns.jinja"
PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def chat_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker with a chat template and an API key (given through the environment)."""
    import os

    os.environ["LLORCH_API_KEY"] = API_KEY
    try:
        live = start_worker(tmp_path_factory.mktemp("chat"), "--chat-template-file", str(TEMPLATE_PATH))
    finally:
        del os.environ["LLORCH_API_KEY"]
    yield live
    stop_worker(live)


@pytest.fixture(scope="module")
def client(chat_worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{chat_worker.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def rendered_chat(ours: LoadedModel, messages: list[dict[str, str]]) -> str:
    return ChatTemplate(TEMPLATE_PATH.read_text(), "<bos>", "<eos>").render(messages)


def test_models_lists_the_loaded_model(client: openai.OpenAI, ours: LoadedModel) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [ours.model_id]
    assert models[0].model_extra["context_length"] == ours.config.context_length


def test_completion_is_greedy_text_with_true_usage(client: openai.OpenAI, model_id: str, served: LoadedModel) -> None:
    result = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    prompt_ids = served.tokenizer.encode(PROMPT)
    expected = greedy_ids(served, prompt_ids, 8)
    assert result.choices[0].text == served.tokenizer.decode(expected)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == len(expected) == 8
    assert result.usage.total_tokens == len(prompt_ids) + 8


def test_stop_finishes_with_stop(client: openai.OpenAI, model_id: str) -> None:
    result = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0,
                                       stop=" country")
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == " the capital of the"


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI, model_id: str) -> None:
    whole = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_renders_the_template_and_streams_the_same_text(
    client: openai.OpenAI, model_id: str, served: LoadedModel
) -> None:
    whole = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=12, temperature=0)
    prompt_ids = served.tokenizer.encode(rendered_chat(served, CHAT), add_special_tokens=False)
    assert prompt_ids.count(served.config.bos_token_id) == 1  # the template's BOS, not a second one
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == served.tokenizer.decode(greedy_ids(served, prompt_ids, 12))
    stream = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seed_reproduces_and_n_gives_distinct_choices(client: openai.OpenAI, model_id: str) -> None:
    kwargs = {"model": model_id, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 42}
    first = client.completions.create(**kwargs, n=3)
    second = client.completions.create(**kwargs, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # each choice has its own generator
    full_length = sum(c.finish_reason == "length" for c in first.choices)
    # 12 tokens for each choice that ran to the limit, fewer for one that met an end-of-generation token
    assert 12 * full_length <= first.usage.completion_tokens <= 12 * len(first.choices)
    if full_length == len(first.choices):
        assert first.usage.completion_tokens == 36


def test_logprobs_are_log_softmax_of_our_logits(client: openai.OpenAI, model_id: str, served: LoadedModel) -> None:
    result = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    prompt_ids = served.tokenizer.encode(PROMPT)
    generated = greedy_ids(served, prompt_ids, 5)
    ids = prompt_ids + generated
    expected = torch.log_softmax(all_logits(served, ids)[len(prompt_ids) - 1 : -1], dim=-1)
    for step, token in enumerate(generated):
        assert logprobs.token_logprobs[step] == pytest.approx(float(expected[step, token]), abs=1e-3)
        assert logprobs.tokens[step] == served.tokenizer.token_text(token)
        top = logprobs.top_logprobs[step]
        assert len(top) == 3
        assert max(top, key=top.get) == logprobs.tokens[step]  # greedy picked the most likely


def test_chat_logprobs_with_top_alternatives(client: openai.OpenAI, model_id: str) -> None:
    result = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)


def test_extras_are_accepted_through_extra_body(client: openai.OpenAI, model_id: str) -> None:
    result = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, temperature=0.8, seed=1,
                                       extra_body={"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.1})
    assert result.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"logit_bias": {"five": 1.0}}, "logit_bias"), ({"logit_bias": {"999999999": 1.0}}, "logit_bias"),
     ({"logit_bias": {"5": 101}}, "logit_bias.5"), ({"prompt": []}, "prompt"), ({"prompt": [[2, 5], []]}, "prompt.1"),
     ({"prompt": [2, 300000]}, "prompt"), ({"prompt": [[2], [2, 300000]]}, "prompt.1"),
     ({"prompt": ["a"] * 65}, "prompt"), ({"max_tokens": 0}, "max_tokens"), ({"best_of": 2}, None),
     ({"extra_body": {"colour": "blue"}}, "colour"), ({"temperature": 2.5}, "temperature"), ({"n": 50}, "n"),
     ({"max_tokens": 40000}, "max_tokens")],
)
def test_unsupported_or_invalid_parameters_are_400(client: openai.OpenAI, model_id: str, kwargs: dict,
                                                   param: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_id, **{"prompt": PROMPT, "max_tokens": 4, **kwargs})
    error = caught.value.body
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)


def test_auth_wrong_or_missing_key_is_401_and_health_stays_open(chat_worker: Worker, model_id: str) -> None:
    wrong = openai.OpenAI(base_url=f"{chat_worker.base_url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.body["code"] == "invalid_api_key"
    missing = httpx.get(f"{chat_worker.base_url}/v1/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{chat_worker.base_url}/health").status_code == 200
    denied = httpx.post(f"{chat_worker.base_url}/execute", json={"job_id": "a", "prompt": "b", "max_tokens": 1})
    assert denied.status_code == 401
    assert denied.json()["errors"][0]["field"] == "authorization"


@pytest.mark.reference
@pytest.mark.parametrize("messages", [
    CHAT,
    [{"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "  2+2?  "}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "Et en français ? 🙂"}],
])
def test_template_rendering_equals_transformers(reference: Reference, messages: list[dict[str, str]]) -> None:
    source = TEMPLATE_PATH.read_text()
    ours = ChatTemplate(source, "<bos>", "<eos>").render(messages)
    theirs = reference.tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                     add_generation_prompt=True)
    assert ours == theirs


def test_template_errors_become_400s(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(ChatTemplateError, match="alternate"):
        ChatTemplate(TEMPLATE_PATH.read_text()).render([{"role": "assistant", "content": "first?"}])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=[{"role": "assistant", "content": "first?"}])
    assert "alternate" in caught.value.body["message"]


def test_templates_render_in_a_sandbox() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
