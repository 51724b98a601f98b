"""What a request may be, checked before the worker spends anything on it, and said when it is refused.

- A request framed twice (Content-Length and Transfer-Encoding) is a 400 before anything
  reads its body: h11 read such a body as chunked and answered 200, which is how requests
  are smuggled past a proxy that reads Content-Length.
- A compressed body (Content-Encoding) is refused as such; bytes that are not UTF-8 are
  said to be so (both were "an unpaired surrogate").
- /tokenize has generation's prompt limit (32768 characters), and its work (tokens, their
  texts, the JSON of the answer) runs off the event loop: /health answers while eight of
  the largest run.
- A chat template that runs out of memory while compiling says so ("to compile", not "to
  render").
"""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Worker, assert_one_line_failure, run_worker_to_exit, start_worker, stop_worker
from llorch.api.fields import MAX_PROMPT_CHARS
from soak import raw_exchange
from tiny_model import write_tiny_gemma3

pytestmark = pytest.mark.cpu

HEALTH_DEADLINE_S = 5.0  # only a blocked event loop misses it


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_worker(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    live = start_worker(tmp_path_factory.mktemp("logs"), "--model", str(tiny_path))
    yield live
    stop_worker(live)


def test_a_body_framed_twice_is_refused_before_it_is_read(tiny_worker: Worker) -> None:
    body = json.dumps({"prompt": "the"}).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n")
    url = tiny_worker.base_url
    answer = raw_exchange(url, head + chunked)  # the worker closes the connection: nothing else is read
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b"Content-Length and Transfer-Encoding" in answer
    # Either framing alone is fine.
    plain = raw_exchange(url, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    assert plain.startswith(b"HTTP/1.1 200 ")
    alone = raw_exchange(url, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked)
    assert alone.startswith(b"HTTP/1.1 200 ")


def test_a_compressed_body_is_refused_as_compressed(tiny_worker: Worker) -> None:
    packed = gzip.compress(json.dumps({"job_id": "gz", "prompt": "the", "max_tokens": 2}).encode())
    encoded = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    with tiny_worker.client() as client:
        execute = client.post("/execute", content=packed, headers=encoded)
        assert execute.status_code == 415
        error = execute.json()["errors"][0]
        assert error["field"] == "body" and "Content-Encoding: gzip" in error["message"]
        openai = client.post("/v1/completions", content=packed, headers=encoded)
        assert openai.status_code == 415 and "uncompressed" in openai.json()["error"]["message"]
        # The same bytes without the header: not text at all, and said so.
        unlabelled = client.post("/execute", content=packed, headers={"Content-Type": "application/json"})
        assert unlabelled.status_code == 400 and "not UTF-8" in unlabelled.json()["errors"][0]["message"]


def test_tokenize_has_the_prompt_limit_of_generation(tiny_worker: Worker) -> None:
    with tiny_worker.client() as client:
        too_long = client.post("/tokenize", json={"prompt": "a" * (MAX_PROMPT_CHARS + 1)})
        assert too_long.status_code == 400
        error = too_long.json()["error"]
        assert error["param"] == "prompt" and str(MAX_PROMPT_CHARS) in error["message"]
        assert client.post("/tokenize", json={"prompt": "a" * MAX_PROMPT_CHARS}).status_code == 200


def test_health_answers_while_the_largest_tokenize_requests_run(tiny_worker: Worker) -> None:
    """Eight prompts of the largest size, in byte tokens (one per character and more), with token texts."""
    prompt = "".join(chr(0x4E00 + i % 20000) for i in range(MAX_PROMPT_CHARS))  # 3 byte tokens each
    answers: list[httpx.Response] = []

    def tokenize() -> None:
        answers.append(httpx.post(f"{tiny_worker.base_url}/tokenize", timeout=120,
                                  json={"prompt": prompt, "return_token_strs": True}))

    threads = [threading.Thread(target=tokenize) for _ in range(8)]
    for thread in threads:
        thread.start()
    with httpx.Client(base_url=tiny_worker.base_url, timeout=HEALTH_DEADLINE_S) as client:
        checks = 0
        while any(thread.is_alive() for thread in threads):
            assert client.get("/health").status_code == 200  # a blocked loop would time out
            checks += 1
    for thread in threads:
        thread.join()
    assert checks > 0
    assert len(answers) == 8 and all(a.status_code == 200 for a in answers)
    body = answers[0].json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) >= 3 * MAX_PROMPT_CHARS


def test_a_template_out_of_memory_while_compiling_says_compile(tiny_path: Path, tmp_path: Path) -> None:
    """jinja2 folds constant expressions when it compiles: this one is 300 MB, and its Python source
    (every byte escaped as four characters) 1.2 GB, before any render."""
    template = tmp_path / "hungry.jinja"
    template.write_text("{{ '\\x01' * 300000000 }}")
    result = run_worker_to_exit("--model", str(tiny_path), "--chat-template-file", str(template))
    assert_one_line_failure(result, "MiB to compile")
