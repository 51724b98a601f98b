"""Tools for a chat template that knows none: the default tool-calling convention, written as plain turns.

A template that reads `tools` (Qwen's, Llama 3.1's, Mistral's) gets OpenAI's tool list
and the structured messages. Any other template (the family templates of
chat_families.py, or a model's own template without tool support) gets this instead:
the function list joins the system message, each earlier call is written in the
assistant's turn as a <tool_call> block, and tool results come back in a user turn as
<tool_response> blocks. The model answers with <tool_call> blocks (the Hermes format),
which the API constrains with a grammar and parses back into tool_calls.
"""

from __future__ import annotations

import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def call_block(name: str, arguments: Any) -> str:
    """One call, exactly as the default convention's grammar makes the model write it."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You can call functions. Their signatures, as JSON schemas:\n<tools>\n" + listing + "\n</tools>\n"
            "To call functions, answer with one block per call and nothing else:\n"
            + call_block("<function name>", "<arguments as a JSON object>").replace('"<', "<").replace('>"', ">"))


def as_plain_turns(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` with tools, calls and results written as text in system, user and assistant turns."""
    turns: list[dict[str, Any]] = []
    if tools:
        preamble = tools_preamble(tools)
        if messages and messages[0]["role"] == "system":
            turns.append({"role": "system", "content": f"{messages[0]['content']}\n\n{preamble}"})
            messages = messages[1:]
        else:
            turns.append({"role": "system", "content": preamble})
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            turns.append({"role": "assistant", "content": "\n".join([content, *calls] if content else calls)})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1].get("tool_results"):  # consecutive results share one user turn
                turns[-1] = {**turns[-1], "content": f"{turns[-1]['content']}\n{response}"}
            else:
                turns.append({"role": "user", "content": response, "tool_results": True})
        else:
            turns.append({"role": role, "content": content})
    return [{"role": t["role"], "content": t["content"]} for t in turns]
