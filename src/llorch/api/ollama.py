"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/show, /api/version."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from llorch.api.state import WorkerState

OPENAPI_MODELS: tuple[type[BaseModel], ...] = ()


def create_ollama_router(state: WorkerState) -> APIRouter:
    return APIRouter()
