"""Request bodies of the pooling routes: OpenAI's /v1/embeddings and the Jina / Cohere rerank shape.

Each input is bounded before anything tokenizes it: at most MAX_INPUTS per request (OpenAI's
own limit), none empty, each at most MAX_PROMPT_CHARS characters or the context's worth of ids.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictBool, StrictStr, field_validator, model_validator

from llorch.api.fields import MAX_PROMPT_CHARS
from llorch.api.openai_fields import Strict, TokenId

MAX_INPUTS = 2048  # inputs of one embeddings request, documents of one rerank request
MAX_INPUT_IDS = 1 << 16  # token ids of one input (the model's context is checked after)

Text = Annotated[StrictStr, Field(max_length=MAX_PROMPT_CHARS)]
Ids = Annotated[list[TokenId], Field(max_length=MAX_INPUT_IDS)]


def check_texts(texts: list[str], field: str) -> list[str]:
    for index, text in enumerate(texts):
        if not text:
            raise ValueError(f"{field}[{index}] is an empty string; every input needs text")
    return texts


class EmbeddingRequest(Strict):
    model: str | None = None
    input: Text | Annotated[list[Text], Field(max_length=MAX_INPUTS)] | Ids | Annotated[
        list[Ids], Field(max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # for the caller's records; nothing to do with the output
    truncate: StrictBool = False  # cut inputs longer than the model's context instead of refusing them

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[str] | list[int] | list[list[int]]) -> str | list[str] | list[int] | list[
            list[int]]:
        if isinstance(value, str):
            check_texts([value], "input")
        elif not value:
            raise ValueError("input is an empty list; send at least one text or token list")
        elif isinstance(value[0], str):
            check_texts(value, "input")  # type: ignore[arg-type]
        elif isinstance(value[0], list) and any(not ids for ids in value):  # type: ignore[union-attr]
            raise ValueError("input holds an empty token list")
        return value

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """One entry per embedding asked for: texts, or token-id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return value  # type: ignore[return-value]


class RerankDocument(Strict):
    text: Text


class RerankRequest(Strict):
    model: str | None = None
    query: Text
    documents: Annotated[list[Text | RerankDocument], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: StrictBool = True
    truncate: StrictBool = False  # cut documents so each pair fits the model's context instead of refusing them

    @model_validator(mode="after")
    def _texts(self) -> RerankRequest:
        check_texts([self.query], "query")
        check_texts(self.texts, "documents")
        return self

    @property
    def texts(self) -> list[str]:
        return [d.text if isinstance(d, RerankDocument) else d for d in self.documents]
