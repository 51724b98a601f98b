"""A request body's validation errors as one message, each naming its field, for every API family.

Each family's error shape holds one message; listing every violation there tells a client
everything to fix at once, as the worker API's list does.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

# A check across fields blames one of them first: "field: why" (or "field.sub: why").
NAMED_MESSAGE = re.compile(r"([a-z_]+(?:\.[0-9a-z_]+)*): ")
UNKNOWN_FIELD = "not supported by this worker (refused, not ignored: it could change the output)"


def violations(exc: ValidationError) -> list[tuple[str | None, str]]:
    """(the field named, "field: why") for each violation, without repeats, in order."""
    found: dict[str, str | None] = {}
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = UNKNOWN_FIELD
        named = NAMED_MESSAGE.match(message)
        if named:  # a model's own check, naming a field of the model at `where`
            field = f"{where}.{named.group(1)}" if where else named.group(1)
            text = f"{where}.{message}" if where else message
        else:
            field = where or None
            text = f"{where}: {message}" if where else message
        found.setdefault(text, field)
    return [(field, text) for text, field in found.items()]


def one_message(exc: ValidationError) -> tuple[str | None, str]:
    """The first violation's field, and every violation in one message ("field: why; field: why")."""
    found = violations(exc)
    return found[0][0], "; ".join(text for _, text in found)
