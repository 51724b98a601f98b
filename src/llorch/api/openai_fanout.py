"""An OpenAI request's jobs: one per prompt and choice, submitted all or none, their events merged.

Each prompt goes through the engine's front door once (chat messages are rendered there);
each of its n choices is one engine job, submitted through the same JobStream as the worker
API. Choice i*n + j is prompt i's j-th. With `echo`, a completion's text and log-probabilities
start with its prompt's, scored by the engine as it reads the prompt. A client that goes
away, streaming or not, cancels every job of its request.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from llorch.api.errors import openai_job_error, openai_refusal
from llorch.api.generation import CLIENT_CLOSED_REQUEST, merged, prepare_all, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.json_answer import json_answer
from llorch.api.openai_choices import (
    ChatShape,
    Choice,
    CompletionShape,
    LogprobEntry,
    ResponseShape,
    UnscoredToken,
    absorb,
    tool_call_deltas,
    usage,
)
from llorch.api.socket_body import socket_body
from llorch.api.streaming import sse
from llorch.api.tool_calls import ToolFormat
from llorch.api.turn import Piece, Turn
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import (
    End,
    Error,
    Event,
    GenerationRequest,
    PreparedJob,
    PromptLogprobs,
    TokenLogprob,
    TokenText,
)


def echo_start(engine: Engine, job: PreparedJob) -> tuple[str, list[LogprobEntry]]:
    """What an echoed choice starts with: the prompt's text, and its unscored first token when it is scored.

    A BOS the worker put in front of given token ids is not echoed: the echo holds exactly the
    client's tokens, each of them scored (a client slicing by position finds its own tokens).
    """
    tokenizer = engine.tokens
    given = job.prompt_ids[1:] if job.added_bos else job.prompt_ids
    text = job.request.prompt if job.request.prompt is not None else tokenizer.decode(given)
    if job.request.prompt_logprobs is None or job.added_bos:
        return text, []
    return text, [UnscoredToken(job.prompt_ids[0], tokenizer.token_text(job.prompt_ids[0]))]


async def generate(http: Request, engine: Engine, body: Any, requests: list[GenerationRequest], chat: bool,
                   tool_format: ToolFormat | None = None, echo: bool = False
                   ) -> JSONResponse | StreamingResponse | Response:
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    streams: list[JobStream] = []
    try:
        prepared = await run_in_threadpool(prepare_all, engine, requests)
        for job in prepared:
            for i in range(body.n):
                index = len(streams)
                streams.append(JobStream(engine, job.for_choice(f"{request_id}-{index}", body.sampling(i))))
    except EngineRefusal as exc:
        for submitted in streams:  # all choices or none
            engine.cancel(submitted.job_id)
        raise openai_refusal(exc) from exc
    prompt_tokens = sum(len(job.prompt_ids) for job in prepared)
    created = int(time.time())
    special = engine.tokens.special_ids
    shape: ResponseShape = (ChatShape(request_id, created, engine.model_id, getattr(body, "legacy_functions", False))
                            if chat else CompletionShape(request_id, created, engine.model_id, special))
    choices: list[Choice] = []
    for job in prepared:  # choice i * n + j is prompt i's j-th
        text, first = echo_start(engine, job) if echo else (None, [])
        for _ in range(body.n):
            choices.append(Choice(len(choices), logprobs=list(first), echo=text,
                                  turn=Turn.for_chat(engine, job, tool_format) if chat else None))
    if body.stream:
        frames = ChunkFrames(engine, streams, choices, shape, body.include_usage, prompt_tokens)
        if len(streams) == 1:  # several are merged, read ahead of what is sent: only the loop writes those
            streams[0].write_directly(lambda event: frames.event(0, event), socket_body(http))
        return StreamingResponse(stream_chunks(frames, streams), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if not await unless_disconnected(http, asyncio.ensure_future(collect(engine, streams, choices))):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the jobs are cancelled
    for choice in choices:
        choice.text = choice.take_echo() + choice.text
    return await json_answer(lambda: shape.response(choices, usage(prompt_tokens, choices)))


async def collect(engine: Engine, streams: list[JobStream], choices: list[Choice]) -> None:
    """Every event of every choice into its Choice; a job's error ends the request."""
    async for index, event in merged(streams):
        if isinstance(event, Error):
            raise openai_job_error(event)
        text = absorb(choices[index], event, keep_text=choices[index].turn is None)
        if choices[index].turn is not None and (text or isinstance(event, End)):
            piece = split_turn(engine, streams[index], choices[index], text, isinstance(event, End))
            choices[index].text += piece.content


def split_turn(engine: Engine, stream: JobStream, choice: Choice, text: str, end: bool) -> Piece:
    """New text of a chat choice split into reasoning, content and calls, recorded in the choice.

    A turn that has ended early (a repeated tool call) cancels its job: the rest would be discarded.
    """
    assert choice.turn is not None
    piece = choice.turn.take(text, end)
    choice.reasoning += piece.reasoning
    choice.tool_calls.extend(piece.calls)
    if choice.turn.finished and not end:
        engine.cancel(stream.job_id)
    return piece


class ChunkFrames:
    """A streamed answer's chunks, event by event, as bytes: the same for the event loop and for the engine
    thread writing them itself (jobs.py). `failed` once an error event has been framed: the stream ends."""

    def __init__(self, engine: Engine, streams: list[JobStream], choices: list[Choice], shape: ResponseShape,
                 include_usage: bool, prompt_tokens: int) -> None:
        self.engine, self.streams, self.choices, self.shape = engine, streams, choices, shape
        self.include_usage, self.prompt_tokens = include_usage, prompt_tokens
        self.failed = False

    def head(self) -> bytes:
        return b"".join(sse(first) for choice in self.choices if (first := self.shape.first_chunk(choice.index)))

    def event(self, index: int, event: Event) -> bytes:
        shape, choice, out = self.shape, self.choices[index], []
        if isinstance(event, Error):
            self.failed = True
            return sse(openai_job_error(event).body())
        if choice.echo is not None and isinstance(event, TokenText | TokenLogprob | End):
            # The prompt is read: its text and log-probabilities go first, in a chunk of their own.
            out.append(sse(shape.chunk(choice, choice.take_echo(), choice.unsent_logprobs())))
        text = absorb(choice, event, keep_text=choice.turn is None)
        if isinstance(event, PromptLogprobs):
            return b"".join(out)
        calls: list[dict[str, Any]] = []
        reasoning = ""
        first = len(choice.tool_calls)
        if choice.turn is not None and (text or isinstance(event, End)):
            piece = split_turn(self.engine, self.streams[index], choice, text, isinstance(event, End))
            text, calls, reasoning = piece.content, piece.calls, piece.reasoning
        if reasoning:
            out.append(sse(shape.reasoning_chunk(index, reasoning)))
        if text or len(choice.logprobs) > choice.streamed_logprobs:
            out.append(sse(shape.chunk(choice, text, choice.unsent_logprobs())))
        for offset, call in enumerate(calls):  # each call: its id and name, then its arguments
            out.extend(sse(shape.tool_chunk(index, delta)) for delta in tool_call_deltas(first + offset, call))
        if isinstance(event, End):
            out.append(sse(shape.chunk(choice, "", choice.unsent_logprobs(), shape.finish(choice))))
        return b"".join(out)

    def tail(self) -> bytes:
        usage_chunk = b""
        if self.include_usage and not self.failed:
            usage_chunk = sse({**self.shape.envelope(), "choices": [],
                               "usage": usage(self.prompt_tokens, self.choices)})
        return usage_chunk + b"data: [DONE]\n\n"


async def stream_chunks(frames: ChunkFrames, streams: list[JobStream]) -> AsyncIterator[bytes]:
    """The chunks over the event loop, an event's at a time (asked for once the last one's are sent)."""
    if head := frames.head():
        yield head
    async for index, event in merged(streams):
        if data := frames.event(index, event):
            yield data
        if frames.failed:
            break
    yield frames.tail()
