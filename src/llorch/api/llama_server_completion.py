"""One llama-server /completion: the job, and its events framed as llama-server's objects.

Apart from the routes (llama_server.py): here a body becomes one engine job, prepared and
submitted like every other API's, and what it produces is reported as llama-server does (a
`data:` line per piece of text and no `[DONE]` when streamed, timings measured from the job's
events, `response_fields`). The engine's refusals and a job's errors take llama-server's shape
here too; the routes use the same for /apply-template.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from llorch.api.errors import LlamaServerError, job_error_parts, refusal_parts
from llorch.api.generation import CLIENT_CLOSED_REQUEST, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.json_answer import json_answer
from llorch.api.llama_server_completion_schemas import LlamaCompletionRequest
from llorch.api.socket_body import socket_body
from llorch.api.streaming import sse
from llorch.api.tokenizer_routes import tokenize_parts
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import (
    End,
    Error,
    Event,
    GenerationRequest,
    PreparedJob,
    Started,
    TokenLogprob,
    TokenText,
)

STOP_TYPES = {"EOS": "eos", "MAX_TOKENS": "limit", "STOP_SEQUENCE": "word", "CANCELLED": "none"}
FIELD_NAMES = {"max_tokens": "n_predict"}  # the engine's names, as this API calls them


def refusal(exc: EngineRefusal) -> LlamaServerError:
    return LlamaServerError(*refusal_parts(exc, FIELD_NAMES))


def job_error(event: Error) -> LlamaServerError:
    return LlamaServerError(*job_error_parts(event))


def prepare(engine: Engine, body: LlamaCompletionRequest, seed: int) -> tuple[PreparedJob, str]:
    """The job (through the engine's front door) and its prompt as text; CPU work, for a worker thread."""
    common: dict[str, Any] = {"sampling": body.sampling(seed), "stop": body.stop_sequences,
                              "constraint": body.constraint(), "logprobs": body.logprobs}
    job_id = f"llama-{uuid.uuid4().hex}"
    if isinstance(body.prompt, str):
        request = GenerationRequest(job_id, body.prompt, body.engine_max_tokens, **common)
    else:
        ids = tokenize_parts(engine, body.prompt, True, "prompt")
        request = GenerationRequest(job_id, None, body.engine_max_tokens, prompt_ids=tuple(ids), **common)
    job = engine.prepare(request)
    return job, engine.tokens.decode(job.prompt_ids, skip_special=False)


@dataclass
class Generation:
    """What one /completion job has produced so far, and when (perf_counter seconds)."""

    prompt_tokens: int
    end_ids: frozenset[int]  # end-of-generation tokens: reported among the probabilities, not among the tokens
    content: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenLogprob] = field(default_factory=list)
    end: End | None = None
    accepted: float | None = None
    first: float | None = None
    ended: float | None = None

    def absorb(self, event: Event) -> str:
        """Record an event; return the text it adds."""
        now = time.perf_counter()
        if isinstance(event, Started):
            self.accepted = now
        elif isinstance(event, TokenLogprob | TokenText) and self.first is None:
            self.first = now
        if isinstance(event, TokenLogprob):
            self.probs.append(event)
            if event.token_id not in self.end_ids:
                self.tokens.append(event.token_id)
        elif isinstance(event, TokenText):
            self.content += event.t
            return event.t
        elif isinstance(event, End):
            self.end, self.ended = event, now
        return ""

    def timings(self) -> dict[str, float]:
        """Measured here, from the job's events: the prompt from acceptance to the first generated token
        (its wait for a place in the batch included), the rest from there to the end."""
        now = self.ended or time.perf_counter()
        first = self.first or now
        prompt_ms = (first - (self.accepted or first)) * 1000
        predicted_ms = (now - first) * 1000
        predicted = self.end.tokens_out if self.end else len(self.tokens)
        return {"prompt_n": self.prompt_tokens, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prompt_per_second": 1000 * self.prompt_tokens / prompt_ms if prompt_ms else 0.0,
                "predicted_n": predicted, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
                "predicted_per_second": 1000 * predicted / predicted_ms if predicted_ms else 0.0}


@dataclass
class Shape:
    """llama-server's /completion objects: a stream's partial chunks, and the final one."""

    body: LlamaCompletionRequest
    engine: Engine
    settings: dict[str, Any]
    prompt: str

    def probabilities(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        def entry(token_id: int, text: str, logprob: float) -> dict[str, Any]:
            return {"id": token_id, "token": text, "logprob": logprob,
                    "bytes": list(self.engine.tokens.token_bytes(token_id, text))}

        return [{**entry(e.token_id, e.token, e.logprob), "top_logprobs": [entry(*top) for top in e.top]}
                for e in entries]

    def partial(self, gen: Generation, text: str, tokens: list[int], probs: list[TokenLogprob]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"index": 0, "content": text, "tokens": tokens, "stop": False,
                                 "id_slot": self.body.id_slot, "tokens_predicted": len(gen.tokens),
                                 "tokens_evaluated": gen.prompt_tokens}
        if self.body.n_probs:
            chunk["completion_probabilities"] = self.probabilities(probs)
        if self.body.timings_per_token:
            chunk["timings"] = gen.timings()
        return chunk

    def final(self, gen: Generation, streamed: bool) -> dict[str, Any]:
        """The last object; a stream has sent the text, tokens and probabilities already."""
        end = gen.end
        assert end is not None
        answer: dict[str, Any] = {
            "index": 0, "content": "" if streamed else gen.content,
            "tokens": gen.tokens if self.body.return_tokens and not streamed else [],
            "id_slot": self.body.id_slot, "stop": True, "model": self.engine.model_id,
            "tokens_predicted": end.tokens_out, "tokens_evaluated": gen.prompt_tokens,
            "generation_settings": self.settings, "prompt": self.prompt, "has_new_line": "\n" in gen.content,
            "truncated": False, "stop_type": STOP_TYPES[end.stop_reason.value],
            "stopping_word": end.stop_sequence_matched or "", "timings": gen.timings()}
        if self.body.n_probs and not streamed:
            answer["completion_probabilities"] = self.probabilities(gen.probs)
        if self.body.response_fields:
            return picked(answer, self.body.response_fields)
        return answer


def picked(answer: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only these fields, a nested one ("a/b") under its whole path."""
    chosen: dict[str, Any] = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            chosen[path] = value
    return chosen


async def complete(http: Request, engine: Engine, body: LlamaCompletionRequest) -> Response:
    seed = body.seed_to_use()
    try:
        job, prompt = await run_in_threadpool(prepare, engine, body, seed)
        stream = JobStream(engine, job)
    except EngineRefusal as exc:
        raise refusal(exc) from exc
    gen = Generation(len(job.prompt_ids), frozenset(engine.tokens.eos_token_ids))
    shape = Shape(body, engine, body.settings(seed, engine.ctx_size, engine.model_id), prompt)
    if body.stream:
        return StreamingResponse(stream.frames(Chunks(gen, shape).event, socket_body(http)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect() -> None:
        async for event in stream.events():
            if isinstance(event, Error):
                raise job_error(event)
            gen.absorb(event)

    if not await unless_disconnected(http, asyncio.ensure_future(collect())):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the job is cancelled
    return await json_answer(lambda: shape.final(gen, streamed=False))


class Chunks:
    """A chunk per piece of text with the tokens and probabilities that came since the last one, then the
    final object: one job event's bytes at a time, for the event loop and the engine thread alike (jobs.py)."""

    def __init__(self, gen: Generation, shape: Shape) -> None:
        self.gen, self.shape = gen, shape
        self.sent_tokens = self.sent_probs = 0

    def event(self, event: Event) -> bytes:
        gen = self.gen
        if isinstance(event, Error):
            return sse(job_error(event).body())
        text = gen.absorb(event)
        out = []
        unsent = len(gen.tokens) > self.sent_tokens or len(gen.probs) > self.sent_probs
        if isinstance(event, TokenText) or (isinstance(event, End) and unsent):
            out.append(sse(self.shape.partial(gen, text, gen.tokens[self.sent_tokens:], gen.probs[self.sent_probs:])))
            self.sent_tokens, self.sent_probs = len(gen.tokens), len(gen.probs)
        if isinstance(event, End):
            out.append(sse(self.shape.final(gen, streamed=True)))
        return b"".join(out)

