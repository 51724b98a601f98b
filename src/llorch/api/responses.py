"""The OpenAI Responses API: /v1/responses."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from llorch.api.state import WorkerState

OPENAPI_MODELS: tuple[type[BaseModel], ...] = ()


def create_responses_router(state: WorkerState) -> APIRouter:
    return APIRouter()
