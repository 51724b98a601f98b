"""OpenAI's function tools: their definitions and the choice of one (`tools`, `tool_choice`).

Apart from the request bodies because other bodies list tools in the same shape (Ollama,
llama-server's /apply-template, /tokenize), and MAX_TOOLS bounds every API's tool list.
"""

from __future__ import annotations

from typing import Any, Literal

from llorch.api.openai_fields import FunctionName, Strict

MAX_TOOLS = 128


class FunctionDefinition(Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction
