"""How far a regular expression's counted repetitions expand, read before the grammar engine sees it.

The grammar engine builds a regex's lexer lazily, one state per position it reaches: `b{1000}{1000}`
is a million positions, and one behind a prefix (`[a-z]{1,20}b{1000}{1000}`) only runs out of the
engine's limits after the prefix has been generated, in the middle of a stream. Counting positions
in the text finds it before the job starts. Python's `re` cannot parse these (it refuses a repeat
of a repeat, which the engine's Rust syntax allows), so this is a small scanner of that syntax:
it only counts, and whatever it does not understand counts as one position, leaving the verdict
to the engine's own limits.

Positions: a character, class or escape is 1; a sequence or an alternation is the sum of its
parts; `x{n}`, `x{n,m}` and `x{n,}` are x times the largest count given; `*`, `+` and `?` add none.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

_COUNTED = re.compile(r"\{(\d{1,9})(?:,(\d{0,9}))?\}")
_LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/[imslux]*")


def positions(pattern: str) -> int:
    """The positions `pattern` expands to (see the module doc)."""
    total, _ = _sequence(pattern, 0)
    return total


def _sequence(text: str, i: int) -> tuple[int, int]:
    """The positions of the alternation starting at `i`, up to its closing parenthesis or the end."""
    branches, current, last = 0, 0, 0
    while i < len(text):
        char = text[i]
        if char == ")":
            return branches + current, i + 1
        if char == "|":
            branches, current, last = branches + current, 0, 0
            i += 1
            continue
        if char == "(":
            last, i = _sequence(text, _group_body(text, i + 1))
        elif char == "[":
            last, i = 1, _class_end(text, i + 1)
        elif char == "\\":
            last, i = 1, _escape_end(text, i + 1)
        elif char in "*+?":
            i += 1
            continue
        elif (counted := _COUNTED.match(text, i)) is not None:
            low, high = counted.groups()
            current += last * (max(int(low), int(high or 0)) - 1)
            last *= max(int(low), int(high or 0))
            i = counted.end()
            continue
        else:
            last, i = 1, i + 1
        current += last
    return branches + current, i


def _group_body(text: str, i: int) -> int:
    """Where a group's pattern starts: past `?P<name>`, `?<name>`, `?:` or flags such as `?i:`
    (a bare flag group, `(?i)`, has an empty body)."""
    if not text.startswith("?", i):
        return i
    if text.startswith(("?P<", "?<"), i) and not text.startswith(("?<=", "?<!"), i):
        close = text.find(">", i)
        return close + 1 if close >= 0 else len(text)
    ends = [at for at in (text.find(":", i), text.find(")", i)) if at >= 0]
    if not ends:
        return len(text)
    end = min(ends)
    return end + 1 if text[end] == ":" else end


def _class_end(text: str, i: int) -> int:
    """Past the `]` closing a class that opened before `i` (nested classes and escapes skipped)."""
    if text.startswith("^", i):
        i += 1
    if text.startswith("]", i):  # a leading ] is a member
        i += 1
    while i < len(text):
        if text[i] == "\\":
            i = _escape_end(text, i + 1)
        elif text[i] == "[":
            i = _class_end(text, i + 1)
        elif text[i] == "]":
            return i + 1
        else:
            i += 1
    return i


def _escape_end(text: str, i: int) -> int:
    """Past an escape whose backslash is before `i`: `\\p{...}`, `\\x{...}` and `\\u{...}` span braces."""
    if i + 1 < len(text) and text[i] in "pPxu" and text[i + 1] == "{":
        close = text.find("}", i)
        return close + 1 if close >= 0 else len(text)
    return i + 1


def schema_patterns(schema: Any) -> Iterator[str]:
    """Every regex a JSON schema holds: `pattern` values and `patternProperties` names, at any depth."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (name for name in value if isinstance(name, str))
            yield from schema_patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from schema_patterns(item)


def lark_patterns(grammar: str) -> Iterator[str]:
    """The `/regex/` literals of a Lark grammar."""
    return (match.group(1) for match in _LARK_REGEX.finditer(grammar))
