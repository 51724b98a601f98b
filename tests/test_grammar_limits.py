"""Grammars a hostile user can send: nested repetitions are 400s naming their field before any token,
what they take does not stay, /health answers meanwhile, and the compiled-grammar cache is bounded
in bytes.

The bombs are short on purpose: `b{1000}{1000}` is 13 bytes and forces a million bytes; before
the grammar limits, each distinct one kept 260 to 670 MB in the cache and answered a 500 or an
error event mid-stream.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import pytest

from conftest import Worker, start_worker, stop_worker
from jobs import make_engine
from llorch.engine.errors import RequestRejected
from llorch.engine.grammar import Grammars
from llorch.engine.regex_size import positions
from llorch.engine.request import Constraint
from llorch.weights.default_model import default_model_path
from llorch.weights.gguf import GGUFFile
from llorch.weights.loader import LoadedModel
from llorch.weights.tokenizer import Tokenizer, tokenizer_from_gguf
from soak import rss_mb

pytestmark = pytest.mark.cpu

T = TypeVar("T")
KINDS = ["regex", "response_format", "lark", "pattern"]
# What eight distinct bombs may add to the worker's resident memory and to its peak: each took
# 260-670 MB before; now each compiles alone within its lexer fuel (tens of MB) and is freed.
BOMBS_RSS_BOUND_MB = 150
# /health is answered within this while grammars compile (as under slow connections, test_worker_http).
HEALTH_DEADLINE_S = 1.0


def bomb(kind: str, n: int, prefix: str = "") -> tuple[str, dict[str, Any], str]:
    """(route, body, field) of the `n`th distinct bomb of `kind`: a nested repetition as OpenAI's `regex`
    shorthand, as a chat response_format, as a Lark grammar or as a JSON schema pattern (/execute).
    A `prefix` regex comes before it: the repetition is then reached only after generating it."""
    if kind == "regex":
        return ("/v1/completions", {"prompt": "b", "max_tokens": 4, "regex": f"{prefix}b{{{1000 + n}}}{{1000}}"},
                "regex")
    if kind == "response_format":
        fmt = {"type": "regex", "regex": f"{prefix}m{{{300 + n}}}{{300}}{{10}}"}
        return ("/v1/chat/completions", {"messages": [{"role": "user", "content": "m"}], "max_tokens": 4,
                                         "response_format": fmt}, "response_format.regex")
    if kind == "lark":
        return ("/execute", {"job_id": f"lark-{n}", "prompt": "b", "max_tokens": 4,
                             "grammar": f"start: /{prefix}b{{{1000 + n}}}{{1000}}/"}, "grammar")
    return ("/execute", {"job_id": f"pattern-{n}", "prompt": "m", "max_tokens": 4,
                         "json_schema": {"type": "string", "pattern": f"^{prefix}m{{{300 + n}}}{{300}}{{10}}$"}},
            "json_schema")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A worker of this module's own: its memory is measured, and its first constrained request is ours."""
    live = start_worker(tmp_path_factory.mktemp("grammar-limits"))
    yield live
    stop_worker(live)


def refusal(answer: httpx.Response) -> tuple[str, str]:
    """(field, message) of a 400 in the worker API's shape or OpenAI's."""
    assert answer.status_code == 400, answer.text
    body = answer.json()
    if "errors" in body:
        return body["errors"][0]["field"], body["errors"][0]["message"]
    return body["error"]["param"], body["error"]["message"]


def health_while(worker: Worker, work: Callable[[], T]) -> tuple[T, float]:
    """`work()`'s result, and the slowest /health answer while it ran (polled back to back)."""
    slowest, done, failures = [0.0], threading.Event(), []

    def poll() -> None:
        with httpx.Client(base_url=worker.base_url, timeout=60) as client:
            while not done.is_set():
                started = time.monotonic()
                if client.get("/health").status_code != 200:
                    failures.append("not 200")
                slowest[0] = max(slowest[0], time.monotonic() - started)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = work()
    finally:
        done.set()
        poller.join()
    assert not failures
    return result, slowest[0]


def test_health_answers_while_the_first_constrained_request_builds_the_vocabulary_view(worker: Worker) -> None:
    """The first constrained request builds llguidance's view of the 262k-token vocabulary, on a
    request thread; /health, polled meanwhile, keeps answering. (llguidance's constructor holds
    the GIL for about a second, so an answer can wait that long: this proves no hang.)"""
    body = {"job_id": "first", "prompt": "A person as JSON:", "max_tokens": 4, "temperature": 0,
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"}}}}

    def first() -> httpx.Response:
        with worker.client() as client:
            return client.post("/execute", json=body)

    answer, slowest = health_while(worker, first)
    assert answer.status_code == 200 and '"type":"end"' in answer.text
    assert slowest < 5, f"/health waited {slowest:.2f} s while the vocabulary view was built"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefix", ["", "[a-z]{1,20}"], ids=["bare", "behind-a-prefix"])
def test_a_nested_repetition_is_a_400_naming_its_field_before_any_token(worker: Worker, kind: str,
                                                                        stream: bool, prefix: str) -> None:
    """Behind a prefix, the first tokens of a probe never reach the repetition: the regex's size is
    what refuses it (before, such a job streamed the prefix, then ended with an error event)."""
    route, body, field = bomb(kind, 0, prefix)
    headers = {}
    if route == "/execute":  # the worker API always streams: SSE, or NDJSON when asked
        headers = {"accept": "application/x-ndjson"} if stream else {}
    else:
        body = {**body, "stream": stream}
    with worker.client() as client:
        answer = client.post(route, json=body, headers=headers)
    named, message = refusal(answer)
    assert named == field
    assert "too complex for the grammar limits" in message, message
    assert "\n" not in message and "<" not in message, message  # one line, none of the engine's markup


def test_eight_distinct_bombs_leave_memory_bounded_and_health_answering(worker: Worker) -> None:
    """Each distinct grammar is compiled anew (the cache cannot help), none of them stays, and
    /health answers at once throughout."""
    with worker.client() as client:  # the vocabulary view is built before the baseline
        client.post("/execute", json={"job_id": "warm", "prompt": "b", "max_tokens": 1,
                                      "grammar": 'start: "b"'}).raise_for_status()
    pid = worker.process.pid
    rss_before, peak_before = rss_mb(pid), rss_mb(pid, "VmHWM")

    def send_bombs() -> list[tuple[str, str]]:
        with worker.client() as client:
            return [(field, refusal(client.post(route, json=body))[0])
                    for route, body, field in (bomb(KINDS[n % len(KINDS)], n) for n in range(1, 9))]

    named, slowest = health_while(worker, send_bombs)
    assert all(expected == got for expected, got in named)
    grown, peak_grown = rss_mb(pid) - rss_before, rss_mb(pid, "VmHWM") - max(peak_before, rss_before)
    assert grown < BOMBS_RSS_BOUND_MB, f"resident memory grew {grown:.0f} MB"
    assert peak_grown < BOMBS_RSS_BOUND_MB, f"peak memory grew {peak_grown:.0f} MB"
    assert slowest < HEALTH_DEADLINE_S, f"/health waited {slowest:.2f} s while the bombs compiled"


def test_grammars_within_the_limits_still_constrain_the_output(worker: Worker) -> None:
    """The limits leave ordinary grammars alone: a bounded repetition and a JSON schema pattern."""
    with worker.client() as client:
        regex = client.post("/v1/completions", json={"prompt": "Digits:", "max_tokens": 12, "temperature": 0,
                                                      "regex": "[0-9]{3}-[0-9]{4}"})
        pattern = client.post("/execute", json={
            "job_id": "pattern-ok", "prompt": "A code:", "max_tokens": 12, "temperature": 0,
            "json_schema": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
            headers={"accept": "application/x-ndjson"})
    assert regex.status_code == 200, regex.text
    text = regex.json()["choices"][0]["text"]
    assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit()
    assert pattern.status_code == 200, pattern.text
    events = [json.loads(line) for line in pattern.text.splitlines() if line]
    code = json.loads("".join(e["t"] for e in events if e["type"] == "token"))
    assert len(code) == 4 and code[:2].isupper() and code[2:].isdigit()


# -- the compiler and its cache, in-process --------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer() -> tuple[Tokenizer, int]:
    """The default model's tokenizer and vocabulary size (no weights)."""
    path = default_model_path()
    metadata = GGUFFile(path).metadata
    return tokenizer_from_gguf(metadata, path), len(metadata["tokenizer.ggml.tokens"])


def schema(n: int) -> str:
    return json.dumps({"type": "object", "properties": {
        f"key_{n}_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{10 + i}}}@[a-z]{{2,{5 + n}}}$"} for i in range(24)}})


def test_the_grammar_cache_is_bounded_in_bytes(tokenizer: tuple[Tokenizer, int]) -> None:
    """Distinct grammars beyond the byte budget evict the least recently used; each is measured."""
    measured = Grammars(*tokenizer)
    sizes = [measured.compile(Constraint("json_schema", schema(n), "json_schema")).nbytes for n in range(12)]
    assert all(size > 0 for size in sizes)
    budget = sum(sizes) // 3
    grammars = Grammars(*tokenizer, cache_bytes=budget)
    compiled = [grammars.compile(Constraint("json_schema", schema(n), "json_schema")) for n in range(12)]
    assert 0 < grammars.cached_bytes <= budget
    assert grammars.compile(Constraint("json_schema", schema(11), "json_schema")) is compiled[11]  # kept
    assert grammars.compile(Constraint("json_schema", schema(0), "json_schema")) is not compiled[0]  # evicted


def test_a_refused_grammar_is_not_cached_and_says_why_on_one_line(tokenizer: tuple[Tokenizer, int]) -> None:
    grammars = Grammars(*tokenizer)
    for source in ("start: /b{1000}{1000}/", 'start: ("b" ~ 1000) ~ 1000'):
        with pytest.raises(RequestRejected) as caught:
            grammars.compile(Constraint("lark", source, "grammar"))
        assert caught.value.field == "grammar" and caught.value.code == "invalid_grammar"
        assert "too complex for the grammar limits" in caught.value.message
        assert "<non-verbose/>" not in caught.value.message and "\n" not in caught.value.message
    assert grammars.cached_bytes == 0


@pytest.mark.parametrize(("pattern", "expected"), [
    (r"^\d{4}-\d{2}-\d{2}$", 12),
    (r"[\w.+-]{1,64}@[a-z]{2,63}\.[a-z]{2,8}", 137),
    (r"(?:ab|c){5}", 15),
    (r"(?P<word>\p{L}{1,100}) \x{41}{3}", 104),
    (r"[\]{]{1000}", 1000),
    (r"[a-z]{1,20}b{1000}{1000}", 1_000_020),
])
def test_a_regex_is_sized_by_its_counted_repetitions(pattern: str, expected: int) -> None:
    """The size that refuses a bomb before any token: every count multiplies what it repeats; escapes and
    classes with braces in them are one position each."""
    assert positions(pattern) == expected


def test_a_grammar_refused_by_its_text_builds_no_vocabulary_view(tokenizer: tuple[Tokenizer, int]) -> None:
    """The view takes about a second, holding Python's lock: a request refused for its text alone
    (too long, a schema that is not one, a regex too large) is answered without it."""
    grammars = Grammars(*tokenizer)
    for constraint in (Constraint("regex", "[a-z]{1,20}b{1000}{1000}", "regex"),
                       Constraint("json_schema", "[1, 2]", "json_schema"),
                       Constraint("lark", "start: /b{1000}{1000}/", "grammar"),
                       Constraint("regex", "a" * (64 << 10), "regex")):
        with pytest.raises(RequestRejected):
            grammars.compile(constraint)
    assert not grammars.vocabulary_ready


@pytest.mark.parametrize("at_start", [False, True])
def test_the_vocabulary_view_is_built_at_start_only_when_asked(served: LoadedModel, at_start: bool) -> None:
    """--grammar-at-start moves the view's build (and its pause of every other answer) into loading;
    without it a worker that never sees a constrained request never pays its memory."""
    engine = make_engine(served, start=False, grammar_at_start=at_start)
    assert engine.front.grammars is not None
    assert engine.front.grammars.vocabulary_ready == at_start
