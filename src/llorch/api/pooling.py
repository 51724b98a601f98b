"""The pooling routes: OpenAI's /v1/embeddings and the rerank route llama.cpp's server and vLLM serve
(/v1/rerank and /rerank, in the Jina / Cohere shape), in OpenAI's error shape.

Each input (each query-document pair) is one engine job, prepared and submitted like a completion's
prompts, all or none; the engine batches jobs of every request into its steps. A client that goes
away before the answer cancels every job of its request.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from llorch.api.body import request_body
from llorch.api.errors import OPENAI_ERROR_SCHEMA, OpenAIError, error_responses, openai_job_error, openai_refusal
from llorch.api.generation import CLIENT_CLOSED_REQUEST, merged, prepare_all, unless_disconnected
from llorch.api.jobs import JobStream
from llorch.api.json_answer import json_answer
from llorch.api.openai import parse_body, ready
from llorch.api.pooling_schemas import EmbeddingRequest, RerankRequest
from llorch.api.state import WorkerState
from llorch.engine.engine import Engine
from llorch.engine.errors import EngineRefusal
from llorch.engine.request import Error, GenerationRequest, Pooled

OPENAPI_MODELS: tuple[type[BaseModel], ...] = (EmbeddingRequest, RerankRequest)
SMALL_CHARS = 2048  # requests and answers this small are prepared and encoded on the event loop
RESPONSES = error_responses(OPENAI_ERROR_SCHEMA, {
    400: "Invalid input, or a model of another kind", 401: "Missing or wrong API key", 404: "Unknown model",
    413: "Body too large", 500: "Inference failed", 503: "Loading, draining or busy"})


Refusal = Callable[[EngineRefusal], Exception]
JobError = Callable[[Error], Exception]


async def pooled(http: Request, engine: Engine, requests: list[GenerationRequest], refusal: Refusal = openai_refusal,
                 job_error: JobError = openai_job_error) -> list[Pooled] | Response:
    """Every request's pooled output, in order; a refusal, a job's error or a gone client ends them all (the first
    two raised as the API's error: `refusal`, `job_error`)."""
    request_id = uuid.uuid4().hex
    requests = [GenerationRequest(f"pool-{request_id}-{i}", r.prompt, 0, prompt_ids=r.prompt_ids, pooled=True,
                                  pair=r.pair, truncate=r.truncate) for i, r in enumerate(requests)]
    streams: list[JobStream] = []
    # A few short texts tokenize faster than a trip to a worker thread; anything larger leaves the event loop.
    small = sum(len(r.prompt or "") + len(r.pair or "") + len(r.prompt_ids or ()) for r in requests) <= SMALL_CHARS
    try:
        prepared = prepare_all(engine, requests) if small else await run_in_threadpool(prepare_all, engine, requests)
        if not small and await http.is_disconnected():  # gone while its inputs were tokenized: nothing to run
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        for job in prepared:
            streams.append(JobStream(engine, job))
    except EngineRefusal as exc:
        for submitted in streams:  # all or none
            engine.cancel(submitted.job_id)
        raise refusal(exc) from exc
    results: list[Pooled | None] = [None] * len(streams)

    async def collect() -> None:
        async for index, event in merged(streams):
            if isinstance(event, Error):
                raise job_error(event)
            if isinstance(event, Pooled):
                results[index] = event

    if not await unless_disconnected(http, asyncio.ensure_future(collect())):
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the jobs are cancelled
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def embedding_values(values: tuple[float, ...], dimensions: int | None, normalize: bool, encoding: str
                     ) -> list[float] | str:
    """One embedding as the client asked: cut to `dimensions` (renormalized when the model normalizes), as
    floats or as base64 of little-endian float32 (OpenAI's encoding)."""
    vector = np.asarray(values, dtype=np.float32)
    if dimensions is not None and dimensions < len(vector):
        vector = vector[:dimensions]
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def check_dimensions(engine: Engine, dimensions: int | None) -> None:
    shape = engine.embedding
    if dimensions is None or shape is None or dimensions == shape.dimensions:
        return
    if dimensions not in shape.matryoshka:
        allowed = f"one of {sorted({*shape.matryoshka, shape.dimensions})}" if shape.matryoshka else (
            f"{shape.dimensions}, its full length; it was not trained for shortened embeddings")
        raise OpenAIError(400, f"dimensions={dimensions}: this model's embeddings can be {allowed}",
                          param="dimensions")


def create_pooling_router(state: WorkerState) -> APIRouter:
    """The pooling routes, without their prefix: app.py serves them under /v1 and at the root."""
    router = APIRouter()

    @router.post("/embeddings", response_model=None, openapi_extra=request_body(EmbeddingRequest),
                 responses=RESPONSES)
    async def embeddings(request: Request) -> JSONResponse | Response:
        try:
            body: EmbeddingRequest = await parse_body(request, EmbeddingRequest, state)
            engine = ready(state)
            check_dimensions(engine, body.dimensions)
            inputs = body.inputs
            outputs = await pooled(request, engine, [
                GenerationRequest("", text, 0, truncate=body.truncate) if isinstance(text, str) else
                GenerationRequest("", None, 0, prompt_ids=tuple(text), truncate=body.truncate) for text in inputs])
        except OpenAIError as exc:
            return exc.response()
        if isinstance(outputs, Response):
            return outputs
        normalize = engine.embedding is not None and engine.embedding.normalized
        tokens = sum(out.prompt_tokens for out in outputs)

        def answer() -> dict[str, Any]:
            return {"object": "list", "model": engine.model_id, "usage": {"prompt_tokens": tokens,
                                                                            "total_tokens": tokens},
                    "data": [{"object": "embedding", "index": i, "embedding": embedding_values(
                        out.values, body.dimensions, normalize, body.encoding_format)}
                        for i, out in enumerate(outputs)]}

        return await json_answer(answer, small=len(outputs) * len(outputs[0].values) <= SMALL_CHARS)

    @router.post("/rerank", response_model=None, openapi_extra=request_body(RerankRequest), responses=RESPONSES)
    async def rerank(request: Request) -> JSONResponse | Response:
        try:
            body: RerankRequest = await parse_body(request, RerankRequest, state)
            engine = ready(state)
            texts = body.texts
            outputs = await pooled(request, engine, [GenerationRequest("", body.query, 0, pair=text,
                                                                       truncate=body.truncate) for text in texts])
        except OpenAIError as exc:
            return exc.response()
        if isinstance(outputs, Response):
            return outputs
        order = sorted(range(len(outputs)), key=lambda i: -outputs[i].values[0])[: body.top_n]
        tokens = sum(out.prompt_tokens for out in outputs)
        results = [{"index": i, "relevance_score": outputs[i].values[0],
                    **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order]
        return await json_answer(lambda: {"id": f"rerank-{uuid.uuid4().hex}", "object": "list",
                                          "model": engine.model_id, "results": results,
                                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                                 small=sum(len(t) for t in texts) <= SMALL_CHARS)

    return router
