"""The OpenAI-compatible API's routes: /v1/models, /v1/completions, /v1/chat/completions (also without /v1).

OPENAPI_MODELS: the request bodies it documents in the app's OpenAPI schema. A route checks
its body and builds the engine requests; openai_fanout.py runs them (one job per prompt and
choice) and openai_choices.py shapes the answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from llorch.api.body import BadRequest, read_json, request_body
from llorch.api.errors import (
    OPENAI_ERROR_SCHEMA,
    OpenAIError,
    error_responses,
)
from llorch.api.generation import tool_constraint
from llorch.api.openai_fanout import generate
from llorch.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from llorch.api.state import WorkerState
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.request import (
    GenerationRequest,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion, or its chunks when stream=true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
                          "data": {"type": "string"}}}}}},
    **error_responses(OPENAI_ERROR_SCHEMA, {
        400: "Invalid or unsupported parameters", 401: "Missing or wrong API key", 404: "Unknown model",
        413: "Body too large", 500: "Generation failed", 503: "Loading, draining or out of memory"}),
}


OPENAPI_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest)


def model_card(engine: Engine) -> dict[str, Any]:
    """The served model as OpenAI's model object, with llorch's facts about it."""
    card = {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "llorch", "kind": engine.kind,
            "context_length": engine.ctx_size, "max_model_len": engine.ctx_size,
            "chat_template": engine.chat_template.name if engine.chat_template else None}
    if engine.embedding is not None:
        card["dimensions"] = engine.embedding.dimensions
    return card


def ready(state: WorkerState) -> Engine:
    """The engine, or a 503 while the worker loads or drains."""
    why = state.unavailable()
    if why or state.engine is None:
        raise OpenAIError(503, why or "unavailable", kind="server_error", code="unavailable")
    return state.engine


def validation_error(exc: ValidationError) -> OpenAIError:
    """Every violation in one message, `param` naming the first."""
    param, message = one_message(exc)
    return OpenAIError(400, message, param=param)


async def parse_body(request: Request, model: type[BaseModel], state: WorkerState) -> Any:
    """A request body validated against `model`, or the OpenAIError naming what is wrong with it.

    A body that names a model must name the one this worker serves (404 otherwise).
    """
    return validate_body(await read_body_json(request), model, state)


async def read_body_json(request: Request) -> Any:
    """The body's JSON, or the OpenAIError saying why it is not (not JSON, too large)."""
    try:
        return await read_json(request)
    except BadRequest as exc:  # the same message in OpenAI's shape
        raise OpenAIError(exc.status, exc.errors[0]["message"]) from exc


def validate_body(raw: Any, model: type[BaseModel], state: WorkerState) -> Any:
    """`raw` validated against `model` (see parse_body)."""
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    engine = ready(state)  # 503 while loading or draining, before anything else
    named_model = getattr(body, "model", None)
    if named_model is not None and named_model != engine.model_id:
        raise OpenAIError(404, f"The model `{named_model}` does not exist; this worker serves "
                          f"`{engine.model_id}`.", param="model", code="model_not_found")
    return body


def create_openai_router(state: WorkerState) -> APIRouter:
    """The OpenAI routes, without their prefix: app.py serves them under /v1 and at the root."""
    router = APIRouter()

    @router.get("/models", response_model=None, responses=error_responses(OPENAI_ERROR_SCHEMA, {503: "Loading"}))
    async def models() -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
        except OpenAIError as exc:
            return exc.response()
        return {"object": "list", "data": [model_card(engine)]}

    @router.get("/models/{model_id:path}", response_model=None, responses=error_responses(
        OPENAI_ERROR_SCHEMA, {404: "Unknown model", 503: "Loading"}))
    async def model(model_id: str) -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
            if model_id != engine.model_id:
                raise OpenAIError(404, f"The model `{model_id[:200]}` does not exist; this worker serves "
                                  f"`{engine.model_id}`.", param="model", code="model_not_found")
        except OpenAIError as exc:
            return exc.response()
        return model_card(engine)

    @router.post("/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def completions(request: Request) -> JSONResponse | StreamingResponse | Response:
        try:
            body = await parse_body(request, CompletionRequest, state)
            engine = ready(state)
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
            if len(body.prompts) * body.n > engine.config.max_queue:
                raise OpenAIError(400, f"{len(body.prompts)} prompts with n={body.n} are "
                                  f"{len(body.prompts) * body.n} jobs; this worker queues at most "
                                  f"{engine.config.max_queue} (--max-queue)", param="prompt")
            scored = body.logprobs if body.echo else None
            # Each choice gets its own sampling (its own seed); the front door checks the first's logit_bias.
            jobs = [GenerationRequest("", prompt if isinstance(prompt, str) else None, max_tokens, body.sampling(0),
                                      stop=body.stop_sequences, logprobs=body.logprobs, constraint=body.constraint(),
                                      prompt_ids=None if isinstance(prompt, str) else tuple(prompt),
                                      prompt_logprobs=scored)
                    for prompt in body.prompts]
            return await generate(request, engine, body, jobs, chat=False, echo=body.echo)
        except OpenAIError as exc:
            return exc.response()

    @router.post("/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
                 responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse | Response:
        try:
            body = await parse_body(request, ChatCompletionRequest, state)
            engine = ready(state)
            top = (body.top_logprobs or 0) if body.logprobs else None
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            fmt, constraint = None, body.constraint()
            if tools and body.tool_mode is not None:
                fmt, constraint = tool_constraint(engine, tools, body.tool_mode, body.parallel_tool_calls)
            job = GenerationRequest("", None, body.max_completion_tokens or body.max_tokens, body.sampling(0),
                                    stop=body.stop_sequences,
                                    logprobs=top, messages=tuple(m.for_template() for m in body.messages),
                                    tools=tuple(tools) if tools else None, constraint=constraint,
                                    chat_options=body.chat_options())
            calls = fmt if body.tool_mode not in (None, "none") else None
            return await generate(request, engine, body, [job], chat=True, tool_format=calls)
        except OpenAIError as exc:
            return exc.response()

    return router
