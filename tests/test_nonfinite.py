"""Non-finite numbers never reach the wire.

- A model whose configuration makes every logit NaN (a finite, positive rope_theta of 1e-300
  with Llama 3 RoPE scaling) is refused at start-up, in one line, after a forward over a
  short text: it used to load, then answer every request for log-probabilities with a
  plain-text 500 ("Out of range float values are not JSON compliant") or stream `NaN`.
- A model that passes that proof but overflows on some input (here one token's embedding
  is 3e38) fails the jobs that ask for log-probabilities of that input with a clear error,
  in JSON, streamed or not; the worker goes on serving.
- A token a grammar rules out has log-probability -inf; among the top alternatives it is
  reported as -9999.0, not as a number JSON cannot carry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import Worker, assert_one_line_failure, run_worker_to_exit, start_worker, stop_worker
from hostile_files import Tensor, tiny_gemma3_parts
from llorch.engine.output import ZERO_PROBABILITY_LOGPROB
from tiny_model import tiny_vocab

pytestmark = pytest.mark.cpu

POISONED = "<0x7E>"  # the byte token of "~": the start-up proof's text has none


def strict_json(text: str) -> Any:
    """JSON as the standard has it: NaN and Infinity are refused."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def poisoned_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The tiny Gemma 3 with one token's input embedding at 3e38 (its output projection, untied, keeps the
    original rows): any prompt holding that token makes NaN logits, and no other does."""
    workdir = tmp_path_factory.mktemp("poisoned")
    parts = tiny_gemma3_parts(workdir)
    embedding = parts.tensor("token_embd.weight")
    parts.tensors.append(Tensor("output.weight", embedding.shape, embedding.ggml_type, embedding.data))
    rows = np.frombuffer(embedding.data, dtype=np.float32).reshape(embedding.shape).copy()
    rows[tiny_vocab()[0].index(POISONED)] = 3e38
    embedding.data = rows.tobytes()
    path = parts.write(workdir / "poisoned.gguf")
    live = start_worker(workdir, "--model", str(path))
    yield live
    stop_worker(live)


def test_a_config_that_makes_the_logits_nan_is_refused_at_start_up(tmp_path: Path) -> None:
    from model_zoo import ARCHITECTURES, build_hf_model, train_tokenizer

    directory = build_hf_model(ARCHITECTURES["llama3-scaled"], tmp_path / "tiny-llama3", train_tokenizer())
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    for holder in (config, config.get("rope_parameters") or {}, config.get("rope_scaling") or {}):
        if "rope_theta" in holder:
            holder["rope_theta"] = 1e-300
    config_file.write_text(json.dumps(config))
    result = run_worker_to_exit("--model", str(directory))
    assert_one_line_failure(result, str(directory), "NaN", "logits", "rope_theta")


def test_nan_log_probabilities_fail_the_job_with_a_clear_error(poisoned_worker: Worker) -> None:
    with poisoned_worker.client() as client:
        clean = client.post("/v1/completions", json={"prompt": "the", "max_tokens": 4, "logprobs": 3})
        assert clean.status_code == 200
        assert all(math.isfinite(v) for v in strict_json(clean.text)["choices"][0]["logprobs"]["token_logprobs"])

        for body in ({"prompt": "the ~", "max_tokens": 4, "logprobs": 3},  # generated tokens' log-probabilities
                     {"prompt": "the ~ the", "max_tokens": 1, "logprobs": 1, "echo": True}):  # the prompt's
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 500 and answer.headers["content-type"] == "application/json", answer.text
            error = strict_json(answer.text)["error"]
            assert error["code"] == "inference_failed" and "not finite" in error["message"], error

            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                assert stream.status_code == 200
                events = [strict_json(line[6:]) for line in stream.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert "not finite" in events[-1]["error"]["message"], events[-1]

        chat = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "~"}], "max_tokens": 4, "logprobs": True})
        assert chat.status_code == 500 and "not finite" in strict_json(chat.text)["error"]["message"]
        assert client.get("/health").json()["status"] == "healthy"


def test_tokens_a_grammar_rules_out_are_reported_with_a_finite_floor(poisoned_worker: Worker) -> None:
    """At the first token of a JSON object only `{` (and whitespace) may come: most of twenty alternatives
    have probability 0, whose logarithm JSON cannot carry."""
    body = {"messages": [{"role": "user", "content": "the"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 20,
            "response_format": {"type": "json_object"}}
    with poisoned_worker.client() as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    first = strict_json(answer.text)["choices"][0]["logprobs"]["content"][0]
    values = [entry["logprob"] for entry in first["top_logprobs"]]
    assert ZERO_PROBABILITY_LOGPROB in values and all(math.isfinite(v) for v in values)
