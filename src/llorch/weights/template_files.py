"""A model's own chat template, from its files: chat_template.jinja or tokenizer_config.json (no torch)."""

from __future__ import annotations

from pathlib import Path

from llorch.errors import ModelFileError
from llorch.weights.limits import MAX_TEMPLATE_CHARS, bounded_text, require_regular_file
from llorch.weights.tokenizer import read_json_object


def hf_chat_template(directory: Path) -> str | None:
    """chat_template.jinja, or tokenizer_config.json's chat_template (a string or named templates)."""
    file = directory / "chat_template.jinja"
    if file.exists():
        return read_template_file(file)
    settings = read_json_object(directory / "tokenizer_config.json", required=False)
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        return None
    return bounded_text(template, "tokenizer_config.json chat_template", MAX_TEMPLATE_CHARS, directory)


def read_template_file(file: Path) -> str:
    """A jinja2 chat template file: a regular file of at most MAX_TEMPLATE_CHARS (bytes, to read no more)."""
    size = require_regular_file(file)
    if size > MAX_TEMPLATE_CHARS:
        raise ModelFileError(file, f"is {size} bytes; a chat template may have at most {MAX_TEMPLATE_CHARS}")
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(file, f"cannot be read as a UTF-8 chat template ({exc})") from exc
