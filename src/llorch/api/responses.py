"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request's input items (after a stored conversation's, with `previous_response_id`)
become chat messages for the template; the job goes through the same front door and
JobStream as chat completions. One OutputBuilder (responses_output.py) turns the job's
text into output items (reasoning, message, function calls) and the stream events that
build them, so a streamed response and a whole one are made by the same code.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from llorch.api.body import request_body
from llorch.api.errors import OPENAI_ERROR_SCHEMA, OpenAIError, error_responses, openai_job_error, openai_refusal
from llorch.api.generation import CLIENT_CLOSED_REQUEST, prepare_all, tool_constraint, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.json_answer import json_answer
from llorch.api.openai import parse_body, ready
from llorch.api.response_store import ResponseStore
from llorch.api.responses_items import INPUT_ITEMS, FunctionCallItem, FunctionCallOutputItem, MessageItem
from llorch.api.responses_output import OutputBuilder, new_id, skeleton
from llorch.api.responses_schemas import ResponseRequest
from llorch.api.socket_body import socket_body
from llorch.api.state import WorkerState
from llorch.api.streaming import sse
from llorch.api.turn import Turn
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import End, Error, Event, GenerationRequest

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
        def frames(job_event: Event) -> bytes:
            """One job event's stream events, for the event loop and the engine thread alike (jobs.py)."""
            if isinstance(job_event, Error):
                return b"".join(sse(event, event["type"]) for event in builder.failed(job_event))
            events_now = builder.feed(job_event)
            if builder.turn.finished and not isinstance(job_event, End):  # a repeated call ended the turn
                engine.cancel(stream.job_id)
            if isinstance(job_event, End):
                keep()  # stored before the client hears it is done: a GET right after finds it
            return b"".join(sse(event, event["type"]) for event in events_now)

        async def events() -> Any:
            yield b"".join(sse(event, event["type"]) for event in builder.started())
            async for data in stream.frames(frames, socket_body(http)):
                yield data

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
    return await json_answer(lambda: builder.response)
