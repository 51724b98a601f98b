"""The chat page at `/`, served by the worker itself: one static file, nothing from a CDN."""

from __future__ import annotations

from fastapi import APIRouter


def create_page_router() -> APIRouter:
    return APIRouter()
