"""Tokenizer endpoints at the server root, in the shapes evaluation tools and pool managers already call.

- GET /tokenizer_info: the special tokens, the chat template and the context length;
- POST /tokenize: a prompt, or chat messages rendered through the template, as token ids
  (token counts without generating anything);
- POST /detokenize: token ids back to text.

/tokenize and /detokenize also take llama-server's bodies (`{"content", "add_special",
"with_pieces"}`; `{"tokens"}`, answered with `content` beside llorch's `prompt`); a
/tokenize body is read in the form its fields belong to, and one mixing both is a 400.

With these, an evaluation needs no local copy of the tokenizer: it tokenizes through
the worker, so its token ids are exactly the ones the worker reads. A prompt (and each
message) has the length limit generation has, and the work a request makes (rendering,
tokenizing, token texts, encoding the answer as JSON) runs on a worker thread, so a few
large requests never hold the event loop that answers /health.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from llorch.api.body import openapi_json_body
from llorch.api.errors import OPENAI_ERROR_SCHEMA, LlamaServerError, OpenAIError, error_responses, openai_refusal
from llorch.api.fields import MAX_PROMPT_CHARS
from llorch.api.llama_server_schemas import LLAMA_TOKENIZE_FIELDS, LlamaTokenizeRequest
from llorch.api.openai import parse_body, read_body_json, ready, validate_body
from llorch.api.openai_fields import Strict, TokenId
from llorch.api.openai_messages import ChatMessage
from llorch.api.openai_tools import MAX_TOOLS, Tool
from llorch.api.state import WorkerState
from llorch.api.violations import one_message
from llorch.engine.engine import Engine
from llorch.engine.errors import RequestRejected
from llorch.engine.request import ChatOptions

MAX_DETOKENIZE_TOKENS = 1 << 18


class TokenizeRequest(Strict):
    """Either `prompt` or chat `messages` (rendered through the model's chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    # Default: BOS and the like are added to a prompt, not to rendered messages (the template spells them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_length(cls, value: str | None) -> str | None:
        """The limit generation has, checked before anything tokenizes the text."""
        if value is not None and len(value) > MAX_PROMPT_CHARS:
            raise ValueError(f"the prompt is {len(value)} characters; at most {MAX_PROMPT_CHARS} are accepted")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        if self.tools and self.messages is None:
            raise ValueError("tools: only with messages")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE_TOKENS)


RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}},
    **error_responses(OPENAI_ERROR_SCHEMA, {400: "Invalid request", 401: "Missing or wrong API key",
                                            404: "Unknown model", 413: "Body too large", 503: "Loading"}),
}


OWN_TOKENIZE_FIELDS = frozenset(TokenizeRequest.model_fields) - {"model"}
OPENAPI_MODELS: tuple[type[BaseModel], ...] = (TokenizeRequest, LlamaTokenizeRequest)
TOKENIZE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": f"#/components/schemas/{model.__name__}"} for model in OPENAPI_MODELS]}}}}}


def render(engine: Engine, messages: list[ChatMessage], tools: list[Tool] | None, options: ChatOptions) -> str:
    """Chat messages rendered with the model's chat template (raises RequestRejected naming the field)."""
    listed = tuple(t.model_dump(exclude_none=True) for t in tools) if tools else None
    return engine.front.render_chat(tuple(m.for_template() for m in messages), listed, options)


def tokenize(engine: Engine, body: TokenizeRequest) -> list[int]:
    """The request's token ids (raises RequestRejected naming the field); CPU work, for a worker thread."""
    if body.messages is not None:
        text = render(engine, body.messages, body.tools, ChatOptions(add_generation_prompt=body.add_generation_prompt))
        return engine.front.encode(text, bool(body.add_special_tokens), "messages")
    assert body.prompt is not None
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    return engine.front.encode(body.prompt, add_special)


def tokenize_answer(engine: Engine, body: TokenizeRequest) -> JSONResponse:
    """/tokenize's whole answer, encoded: for a worker thread (the token texts and the JSON of a long
    prompt take as long as tokenizing it)."""
    ids = tokenize(engine, body)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": engine.ctx_size, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = [engine.tokens.token_text(i) for i in ids]
    return JSONResponse(answer)


def tokenize_parts(engine: Engine, parts: str | list[int | str], add_special: bool, field: str) -> list[int]:
    """llama-server's prompt forms as token ids: a text, or ids and texts in order (each text tokenized on its
    own; BOS, when asked for, only in front of a text that comes first, as llama-server adds it)."""
    ids: list[int] = []
    for index, part in enumerate([parts] if isinstance(parts, str) else parts):
        if isinstance(part, str):
            ids.extend(engine.front.encode(part, add_special and index == 0, field))
        else:
            ids.append(part)
    return ids


def piece(engine: Engine, token_id: int) -> str | list[int]:
    """llama-server's `piece`: the token's text when its bytes are UTF-8 on their own, else the byte values."""
    raw = engine.tokens.token_bytes(token_id)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return list(raw)


def llama_tokenize_answer(engine: Engine, body: LlamaTokenizeRequest) -> JSONResponse:
    """/tokenize's answer to llama-server's body (CPU work, for a worker thread)."""
    ids = tokenize_parts(engine, body.content, body.add_special, "content")
    engine.front.check_token_ids(tuple(ids), field="content")
    if body.with_pieces:
        return JSONResponse({"tokens": [{"id": i, "piece": piece(engine, i)} for i in ids]})
    return JSONResponse({"tokens": ids})


async def llama_tokenize(state: WorkerState, raw: dict[str, Any]) -> JSONResponse:
    """/tokenize with llama-server's body, its errors in llama-server's shape."""
    try:
        try:
            engine = ready(state)
        except OpenAIError as exc:
            raise LlamaServerError(exc.status, exc.message, exc.headers) from exc
        mixed = sorted(OWN_TOKENIZE_FIELDS & raw.keys())
        if mixed:
            raise LlamaServerError(400, f"{mixed[0]}: llama-server's /tokenize body (content, add_special, "
                                   "with_pieces) and llorch's (prompt or messages, ...) cannot be mixed")
        try:
            body = LlamaTokenizeRequest.model_validate(raw)
        except ValidationError as exc:
            raise LlamaServerError(400, one_message(exc)[1]) from exc
        try:
            return await run_in_threadpool(llama_tokenize_answer, engine, body)
        except RequestRejected as exc:
            raise LlamaServerError(400, f"{exc.field}: {exc.message}") from exc
    except LlamaServerError as exc:
        return exc.response()


def create_tokenizer_router(state: WorkerState) -> APIRouter:
    router = APIRouter()

    @router.get("/tokenizer_info", response_model=None, responses=RESPONSES)
    async def tokenizer_info() -> dict[str, Any] | JSONResponse:
        try:
            engine = ready(state)
        except OpenAIError as exc:
            return exc.response()
        tokenizer = engine.tokens
        eos = tokenizer.eos_token_id
        template = engine.chat_template
        return {
            "tokenizer_class": "llorch",
            "bos_token": tokenizer.token_text(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else None,
            "eos_token": tokenizer.token_text(eos) if eos is not None else None,
            "pad_token": None,  # the worker never pads: every sequence keeps its own length
            "chat_template": template.source if template else None,
            "model_max_length": engine.ctx_size,
            "vocab_size": engine.model_config.vocab_size,
        }

    @router.post("/tokenize", response_model=None, openapi_extra=TOKENIZE_BODY, responses=RESPONSES)
    async def tokenize_route(request: Request) -> JSONResponse:
        try:
            raw = await read_body_json(request)
            if isinstance(raw, dict) and LLAMA_TOKENIZE_FIELDS & raw.keys():
                return await llama_tokenize(state, raw)
            body = validate_body(raw, TokenizeRequest, state)
            engine = ready(state)
            try:
                return await run_in_threadpool(tokenize_answer, engine, body)
            except RequestRejected as exc:
                raise openai_refusal(exc) from exc
        except OpenAIError as exc:
            return exc.response()

    @router.post("/detokenize", response_model=None, openapi_extra=openapi_json_body(DetokenizeRequest),
                 responses=RESPONSES)
    async def detokenize_route(request: Request) -> JSONResponse:
        try:
            body = await parse_body(request, DetokenizeRequest, state)
            engine = ready(state)
            try:
                engine.front.check_token_ids(tuple(body.tokens), field="tokens")
            except RequestRejected as exc:
                raise openai_refusal(exc) from exc
        except OpenAIError as exc:
            return exc.response()
        # `prompt` is llorch's (vLLM's) name for the text, `content` llama-server's: the bodies are the same.
        return await run_in_threadpool(lambda: JSONResponse(
            {"prompt": (text := engine.tokens.decode(body.tokens)), "content": text}))

    return router
