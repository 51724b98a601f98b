"""Anthropic Messages API: /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from llorch.api.state import WorkerState

OPENAPI_MODELS: tuple[type[BaseModel], ...] = ()


def create_anthropic_router(state: WorkerState) -> APIRouter:
    return APIRouter()
