"""Tool calls: each template family's call format, the grammar that makes the model follow it, and its parser.

Formats, chosen from the chat template's own text:
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call (Qwen, Hermes, and
  llorch's default for templates that define no tool format, see weights/tool_prompt.py);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- llama3: a bare `{"name": ..., "parameters": {...}}` object (one call per turn).

The grammar (Lark, for llguidance) embeds the functions' JSON schemas, so arguments always
parse and validate. With tool_choice "auto" the model may write text instead; that text
can never contain the call marker, so once the marker starts, the call is constrained.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from llorch.engine.json_bounds import JSON_OPTIONS, bounded
from llorch.weights.tool_prompt import CALL_CLOSE, CALL_OPEN

# The most calls one turn may hold: a small model can otherwise repeat calls until max_tokens.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolFormat:
    name: str
    arguments_key: str  # "arguments", or Llama 3's "parameters"
    marker: str  # what starts the calls ("" for a bare object)


HERMES = ToolFormat("hermes", "arguments", CALL_OPEN)
MISTRAL = ToolFormat("mistral", "arguments", "[TOOL_CALLS]")
LLAMA3 = ToolFormat("llama3", "parameters", "")


def format_for(template_source: str | None, template_reads_tools: bool) -> ToolFormat:
    if not template_reads_tools or not template_source:
        return HERMES  # the default convention's plain turns
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if CALL_OPEN not in template_source and ("<|python_tag|>" in template_source or "ipython" in template_source):
        return LLAMA3
    return HERMES


def _call_schema(tools: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """One schema for a call of any of `tools`: {"name": <const>, key: <that function's arguments>}.

    Each function's parameters move under `$defs` with their references rebased, so a schema
    that refers to its own definitions (`#/$defs/Item`, or `#` for a recursive one) still
    resolves inside the wrapper.
    """
    definitions: dict[str, Any] = {}
    variants = []
    for index, tool in enumerate(tools):
        name = f"llorch_arguments_{index}"
        definitions[name] = _rebased(tool["function"].get("parameters") or {"type": "object"}, f"#/$defs/{name}")
        variants.append({"type": "object", "properties": {
            "name": {"const": tool["function"]["name"]}, key: {"$ref": f"#/$defs/{name}"},
        }, "required": ["name", key], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**bounded({**schema, "$defs": definitions}), "x-guidance": JSON_OPTIONS}


def _rebased(node: Any, base: str) -> Any:
    """`node` with every local reference ("#...") made relative to `base` instead of the document's root."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
            for k, v in node.items()}


def _literal(text: str) -> str:
    return json.dumps(text)


def grammar(fmt: ToolFormat, tools: list[dict[str, Any]], mode: str, parallel: bool,
            special_ids: dict[str, int]) -> str:
    """A Lark grammar for the assistant's turn. `mode`: "none", "auto", "required" or a function name."""
    if mode not in ("none", "auto", "required"):
        tools = [t for t in tools if t["function"]["name"] == mode]
    schema = _call_schema(tools, fmt.arguments_key)
    marker_id = special_ids.get(fmt.marker) if fmt.marker else None
    # Free text: anything without the marker (a special-token marker cannot occur in text at all).
    if fmt is LLAMA3:
        text = r"TEXT: /[^{](.|\n)*/"
    elif marker_id is not None:
        text = r"TEXT: /(.|\n)+/"
    else:
        text = rf"TEXT: /(.|\n)+/ & ~/(.|\n)*{re.escape(fmt.marker)}(.|\n)*/"
    marker = f"<[{marker_id}]>" if marker_id is not None else _literal(fmt.marker)
    if fmt is MISTRAL:
        array = {"type": "array", "items": schema, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        calls = f"calls: {marker} %json {json.dumps(array)}"
    elif fmt is LLAMA3:
        calls = f"calls: %json {json.dumps(schema)}"
    else:
        more = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        calls = (f"calls: call{more}\ncall: {marker} \"\\n\" body \"\\n\" {_literal(CALL_CLOSE)}\n"
                 f"body: %json {json.dumps(schema)}")
    start = {"none": "start: TEXT?", "auto": "start: TEXT? | TEXT? calls"}.get(mode, "start: calls")
    if fmt is LLAMA3 and mode == "auto":
        start = "start: TEXT? | calls"
    return f"{start}\n{calls}\n{text}\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallParser:
    """Splits the model's text, as it streams, into content and completed tool calls.

    hermes calls are recognised one by one as each closes; the other formats are decided
    by the first character that is not white space, then read whole at the end.

    A call that repeats an earlier one of the turn word for word ends the turn (`finished`):
    a small model that may make several calls tends to repeat its call until max_tokens
    instead of ending, and an identical second call adds nothing. The API cancels the job
    then, and the turn ends with the calls made so far. A call cut short by max_tokens is
    dropped, never returned as text.
    """

    fmt: ToolFormat
    _buffer: str = ""
    _in_calls: bool = False
    _decided: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False  # a repeated call ended the turn: nothing after it counts

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """New content to send now, and the calls completed by this text."""
        if self.finished:
            return "", []
        self._buffer += text
        if self.fmt is HERMES:
            return self._hermes()
        if not self._decided:
            stripped = self._buffer.lstrip()
            if not stripped:
                return "", []
            self._decided = True
            opener = "{" if self.fmt is LLAMA3 else "["
            self._in_calls = stripped.startswith(opener)
        if self._in_calls:
            return "", []
        out, self._buffer = self._buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end: content, and calls (of the formats read whole)."""
        rest, self._buffer = self._buffer, ""
        if self.finished:
            return "", []
        if not self._in_calls:
            return rest, []
        if self.fmt is HERMES:
            return "", []  # an unclosed call, cut by max_tokens
        try:
            parsed = json.loads(rest.strip().removeprefix(self.fmt.marker))
        except ValueError:
            return "", []  # cut short
        items = parsed if isinstance(parsed, list) else [parsed]
        return "", self._accept([item for item in items if isinstance(item, dict)])

    def _hermes(self) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if not self._in_calls:
            at = self._buffer.find(CALL_OPEN)
            if at < 0:
                cut = len(self._buffer) - partial_suffix(self._buffer, CALL_OPEN)
                content, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return content, []
            content, self._buffer, self._in_calls = self._buffer[:at], self._buffer[at:], True
        items: list[dict[str, Any]] = []
        while (end := self._buffer.find(CALL_CLOSE)) >= 0:
            block, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE):]
            body = block.split(CALL_OPEN, 1)[-1].strip()
            try:
                item = json.loads(body)
            except ValueError:
                continue
            if isinstance(item, dict):
                items.append(item)
        return content, self._accept(items)

    def _accept(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """New calls from parsed items, up to the first that repeats an earlier call (which finishes the turn)."""
        seen = {(c["function"]["name"], c["function"]["arguments"]) for c in self.calls}
        done = []
        for item in items:
            call = self._call(item)
            key = (call["function"]["name"], call["function"]["arguments"])
            if key in seen:
                self.finished, self._buffer = True, ""
                break
            seen.add(key)
            done.append(call)
        self.calls.extend(done)
        return done

    def _call(self, item: dict[str, Any]) -> dict[str, Any]:
        arguments = item.get(self.fmt.arguments_key, {})
        return {"id": new_call_id(), "type": "function", "function": {
            "name": str(item.get("name", "")), "arguments": json.dumps(arguments, ensure_ascii=False)}}


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could begin `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
