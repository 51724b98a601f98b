"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request's input items (after a stored conversation's, with `previous_response_id`)
become chat messages for the template; the job goes through the same front door and
JobStream as chat completions. One OutputBuilder turns the job's text into output items
(reasoning, message, function calls) and the stream events that build them, so a
streamed response and a whole one are made by the same code.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from llorch.api.body import request_body
from llorch.api.errors import OPENAI_ERROR_SCHEMA, OpenAIError, error_responses, openai_job_error, openai_refusal
from llorch.api.generation import CLIENT_CLOSED_REQUEST, prepare_all, tool_constraint, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.openai import parse_body, ready
from llorch.api.response_store import ResponseStore
from llorch.api.responses_schemas import (
    INPUT_ITEMS,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponseRequest,
)
from llorch.api.state import WorkerState
from llorch.api.streaming import sse
from llorch.api.turn import Piece, Turn
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import End, Error, GenerationRequest, StopReason, TokenText

OPENAPI_MODELS: tuple[type[BaseModel], ...] = (ResponseRequest,)

# The engine names what it refuses in its own words; a Responses client knows these fields.
FIELD_NAMES = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input"}

_OBJECT = {"application/json": {"schema": {"type": "object"}}}
CREATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A response, or its events when stream=true",
          "content": {**_OBJECT, "text/event-stream": {"schema": {"type": "object", "required": ["event", "data"],
                                                                  "properties": {"event": {"type": "string"},
                                                                                 "data": {"type": "string"}}}}}},
    **error_responses(OPENAI_ERROR_SCHEMA, {
        400: "Invalid or unsupported parameters", 401: "Missing or wrong API key",
        404: "Unknown model or previous_response_id", 413: "Body too large", 500: "Generation failed",
        503: "Loading, draining or out of memory"}),
}
STORED_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The stored response", "content": _OBJECT},
    **error_responses(OPENAI_ERROR_SCHEMA, {400: "Unsupported query", 401: "Missing or wrong API key",
                                            404: "No such stored response"}),
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_stored(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(404, f"{param}: no stored response has the id {response_id[:100]!r} (unknown, deleted, "
                       "evicted, or created with store=false)", param=param, code="not_found")


def template_messages(instructions: str | None, items: list[Any], first_new: int = 0) -> list[dict[str, Any]]:
    """Input items as the chat template's messages (OpenAI's chat shape); reasoning items are dropped.

    Items before `first_new` come from a stored conversation; errors name the request's own items.
    """
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}  # call_id -> the function it called
    for index, item in enumerate(items):
        if isinstance(item, MessageItem):  # templates know "system"; "developer" means the same
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": json.loads(item.arguments)}}
            if messages and messages[-1]["role"] == "assistant":  # calls join the assistant's turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                where = f"input.{index - first_new}.call_id"
                raise OpenAIError(400, f"{where}: no function_call item before it has the call_id "
                                  f"{item.call_id[:100]!r}", param=where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "name": names[item.call_id],
                             "content": item.text})
    return messages


def as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as input items of the next turn (they have the input shapes already)."""
    return [item for item in output if item["type"] in ("message", "function_call", "reasoning")]


def create_responses_router(state: WorkerState) -> APIRouter:
    router = APIRouter()  # app.py serves it under /v1 and at the root
    store = ResponseStore()

    @router.post("/responses", response_model=None, openapi_extra=request_body(ResponseRequest),
                 responses=CREATE_RESPONSES)
    async def create(request: Request) -> JSONResponse | StreamingResponse | Response:
        try:
            body: ResponseRequest = await parse_body(request, ResponseRequest, state)
            engine = ready(state)
            history: list[dict[str, Any]] = []
            if body.previous_response_id is not None:
                previous = store.get(body.previous_response_id)
                if previous is None:
                    raise not_stored(body.previous_response_id, "previous_response_id")
                history = previous.conversation + as_input(previous.response["output"])
            new_items = [item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in body.items]
            return await respond(request, engine, body, history, new_items, store)
        except OpenAIError as exc:
            return exc.response()

    @router.get("/responses/{response_id}", response_model=None, responses=STORED_RESPONSES)
    async def retrieve(request: Request, response_id: str) -> JSONResponse:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            return OpenAIError(400, "stream: replaying a stored response as events is not supported; "
                               "retrieve it whole", param="stream").response()
        stored = store.get(response_id)
        if stored is None:
            return not_stored(response_id, "response_id").response()
        return JSONResponse(stored.response)

    @router.delete("/responses/{response_id}", response_model=None, responses=STORED_RESPONSES)
    async def delete(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            return not_stored(response_id, "response_id").response()
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router


async def respond(http: Request, engine: Engine, body: ResponseRequest, history: list[dict[str, Any]],
                  new_items: list[dict[str, Any]], store: ResponseStore
                  ) -> JSONResponse | StreamingResponse | Response:
    conversation = history + new_items
    items = INPUT_ITEMS.validate_python(conversation)
    tools = [t.for_template() for t in body.tools or []]
    mode = body.tool_mode
    constraint = body.constraint()
    call_format = None
    if tools and mode is not None:
        callable_tools = [t.for_template() for t in body.callable_tools]
        fmt, constraint = tool_constraint(engine, callable_tools, mode, body.parallel_tool_calls is not False)
        call_format = fmt if mode != "none" else None
    response_id = new_id("resp")
    job = GenerationRequest(response_id, None, body.max_output_tokens, body.sampling(),
                            messages=tuple(template_messages(body.instructions, items, len(history))),
                            tools=tuple(tools) if tools else None, constraint=constraint)
    try:
        prepared = (await run_in_threadpool(prepare_all, engine, [job]))[0]
        stream = JobStream(engine, prepared)
    except EngineRefusal as exc:
        error = openai_refusal(exc)
        error.param = FIELD_NAMES.get(error.param or "", error.param)
        raise error from exc
    builder = OutputBuilder(skeleton(response_id, engine.model_id, body),
                            Turn.for_chat(engine, prepared, call_format), len(prepared.prompt_ids))

    def keep() -> None:
        if body.store is not False:
            store.put(builder.response, conversation)

    if body.stream:
        async def events() -> Any:
            for event in builder.started():
                yield sse(event, event["type"])
            async for job_event in stream.events():
                if isinstance(job_event, Error):
                    for event in builder.failed(job_event):
                        yield sse(event, event["type"])
                    return
                events_now = builder.feed(job_event)
                if builder.turn.finished and not isinstance(job_event, End):  # a repeated call ended the turn
                    engine.cancel(stream.job_id)
                if isinstance(job_event, End):
                    keep()  # stored before the client hears it is done: a GET right after finds it
                for event in events_now:
                    yield sse(event, event["type"])

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect() -> None:
        async for job_event in stream.events():
            if isinstance(job_event, Error):
                raise openai_job_error(job_event)
            builder.feed(job_event)
            if builder.turn.finished and not isinstance(job_event, End):  # a repeated call ended the turn
                engine.cancel(stream.job_id)

    if not await unless_disconnected(http, asyncio.ensure_future(collect())):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the job is cancelled
    keep()
    return JSONResponse(builder.response)


def skeleton(response_id: str, model: str, body: ResponseRequest) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed as OpenAI's clients read them."""
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {}, "model": model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": body.reasoning.summary if body.reasoning else None},
        "service_tier": "default", "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature, "text": body.echoed_text(),
        "tool_choice": body.echoed_tool_choice(), "tools": [t.echoed() for t in body.tools or []],
        "top_logprobs": 0, "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "usage": None, "user": body.user,
    }


class OutputBuilder:
    """A job's text as output items, and the stream events that build them, in order.

    Thoughts (when the model thinks) make a reasoning item; text a message; each tool call
    a function_call item. Text that is only white space opens no message until more comes:
    before a call it is dropped, as chat completions drop it.
    """

    def __init__(self, response: dict[str, Any], turn: Turn, input_tokens: int) -> None:
        self.response = response
        self.turn = turn
        self.input_tokens = input_tokens
        self.sequence = 0
        self.open: dict[str, Any] | None = None  # the message or reasoning item being written
        self.held = ""  # white space not yet sent
        self.reasoning_tokens = 0
        self.answering = turn.reasoning is None  # whether the thought (if any) has ended

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def started(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def feed(self, event: Any) -> list[dict[str, Any]]:
        if isinstance(event, TokenText):
            return self.text(event.t)
        if isinstance(event, End):
            return self.finish(event)
        return []

    def text(self, text: str) -> list[dict[str, Any]]:
        piece = self.turn.take(text)
        if not self.answering:  # tokens before the first of the answer (counted when there was a thought)
            self.answering = bool(piece.content or piece.calls)
            self.reasoning_tokens += not self.answering
        return self.render(piece)

    def render(self, piece: Piece) -> list[dict[str, Any]]:
        events = self.think(piece.reasoning) + self.say(piece.content)
        for call in piece.calls:
            events += self.call(call)
        return events

    def think(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events = self.close()
            events += self.start({"id": new_id("rs"), "type": "reasoning", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": ""}]})
        return events + self.append(text, "response.reasoning_text.delta")

    def say(self, text: str, force: bool = False) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            self.held += text
            if not self.held.strip() and not force:
                return []
            events = self.close()
            events += self.start({"id": new_id("msg"), "type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": "", "annotations": []}]})
            text, self.held = self.held, ""
        if not text:
            return events
        return events + self.append(text, "response.output_text.delta", logprobs=[])

    def start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A message or reasoning item begins: added (empty), then its one content part."""
        item["status"] = "in_progress"
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        added = {**item, "content": []}
        return [self.event("response.output_item.added", output_index=index, item=copy.deepcopy(added)),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=copy.deepcopy(item["content"][0]))]

    def append(self, text: str, kind: str, **extra: Any) -> list[dict[str, Any]]:
        assert self.open is not None
        self.open["content"][0]["text"] += text
        return [self.event(kind, item_id=self.open["id"], output_index=len(self.output) - 1, content_index=0,
                           delta=text, **extra)]

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index, part = len(self.output) - 1, item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            done = self.event("response.output_text.done", **where, text=part["text"], logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", **where, text=part["text"])
        return [done, self.event("response.content_part.done", **where, part=copy.deepcopy(part)),
                self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.held = ""  # white space before a call is not an answer
        function = call["function"]
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": "completed"}
        self.output.append(item)
        index = len(self.output) - 1
        return [
            *events,
            self.event("response.output_item.added", output_index=index,
                       item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=item["arguments"]),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def finish(self, end: End) -> list[dict[str, Any]]:
        events = self.render(self.turn.take("", end=True))
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self.say("", force=True)  # every answer has a message, if nothing else
        cut = end.stop_reason is StopReason.MAX_TOKENS
        events += self.close("incomplete" if cut else "completed")
        self.response.update({
            "status": "incomplete" if cut else "completed", "completed_at": None if cut else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0,
                                                                                 "cache_write_tokens": 0},
                      "output_tokens": end.tokens_out,
                      "output_tokens_details": {"reasoning_tokens": self.thought_tokens(end)},
                      "total_tokens": self.input_tokens + end.tokens_out}})
        kind = "response.incomplete" if cut else "response.completed"
        return [*events, self.event(kind, response=self.snapshot())]

    def thought_tokens(self, end: End) -> int:
        thought = any(item["type"] == "reasoning" for item in self.output)
        return min(self.reasoning_tokens, end.tokens_out) if thought else 0

    def failed(self, error: Error) -> list[dict[str, Any]]:
        """The job ended in an error: an `error` event, then the response as failed."""
        status = openai_job_error(error)
        events = self.close("incomplete")
        self.response.update({"status": "failed", "error": {"code": "server_error", "message": error.message}})
        return [*events, self.event("error", code=status.code, message=error.message, param=None),
                self.event("response.failed", response=self.snapshot())]
