"""JSON a model can finish: numbers of bounded length, and the layout options every JSON grammar uses.

A JSON schema's `{"type": "number"}` admits numbers of any length, and a small model that
has started `1000000...` may never stop. Like llama.cpp's JSON grammars (at most 16 integral
digits), every number or integer the schema leaves unbounded gets bounds here: at most 15
integral digits, and at most 10 decimals (as `multipleOf`, the keyword the grammar engine
enforces digit by digit; it cannot express more decimals exactly). Bounds the schema sets
itself are kept. Values the schema leaves open (`{}`, an object without properties) are
spelled out as "any JSON value" with the same bounded numbers, nested at most OPEN_DEPTH
deep, with at most OPEN_MAX_KEYS keys per object and OPEN_MAX_ITEMS items per array.

An object whose schema lists its properties and says nothing of others gets only those
(`additionalProperties: false`), as llama.cpp's and xgrammar's strict modes read it: a
model may otherwise invent keys until max_tokens instead of closing the object.
"""

from __future__ import annotations

from typing import Any

# 15 digits: the grammar engine compares bounds as doubles, which hold every 15-digit integer exactly
# (10**16 - 1 would round to 10**16 and let a 17-digit number through).
MAX_INTEGRAL = 10**15 - 1
DECIMAL_STEP = 1e-10  # 10 decimals
# Compact layout, spaced like json.dumps: no free whitespace a model could loop in.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Open values (json_object mode, or a schema that leaves a value open) are spelled out level by
# level: a small model otherwise nests `{"items": {"items": ...` or invents keys until max_tokens.
OPEN_DEPTH = 6
OPEN_MAX_KEYS = 24
OPEN_MAX_ITEMS = 64
ANY_NAME = "llorch_any_json_"

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def any_ref(depth: int) -> dict[str, Any]:
    return {"$ref": f"#/$defs/{ANY_NAME}{depth}"}


def any_json(depth: int) -> dict[str, Any]:
    """Any JSON value that nests at most OPEN_DEPTH - depth more levels, with the numbers bounded."""
    scalars: list[dict[str, Any]] = [{"type": "string"}, bound_number({"type": "number"}), {"type": "boolean"},
                                     {"type": "null"}]
    if depth >= OPEN_DEPTH:
        return {"anyOf": scalars}
    inner = any_ref(depth + 1)
    return {"anyOf": [*scalars, {"type": "array", "items": inner, "maxItems": OPEN_MAX_ITEMS},
                      {"type": "object", "additionalProperties": inner, "maxProperties": OPEN_MAX_KEYS}]}


def bound_number(schema: dict[str, Any]) -> dict[str, Any]:
    types = schema.get("type")
    kinds = set(types) if isinstance(types, list) else {types}
    if not kinds & {"number", "integer"} or len(kinds) > 1:
        return schema  # a type list mixing numbers with others: bounds would apply to all of them
    out = dict(schema)
    if not any(k in out for k in ("minimum", "exclusiveMinimum", "const", "enum")):
        out["minimum"] = -MAX_INTEGRAL
    if not any(k in out for k in ("maximum", "exclusiveMaximum", "const", "enum")):
        out["maximum"] = MAX_INTEGRAL
    if "number" in kinds and "multipleOf" not in out and not any(k in out for k in ("const", "enum")):
        out["multipleOf"] = DECIMAL_STEP
    return out


def bounded(schema: Any) -> Any:
    """`schema` with every number it leaves unbounded bounded (a new schema; the argument is not changed)."""
    uses_any = [False]

    def visit(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _ONE:
            if isinstance(out.get(key), dict):
                out[key] = visit(out[key])
        for key in _MANY:
            if isinstance(out.get(key), list):
                out[key] = [visit(item) for item in out[key]]
        for key in _NAMED:
            if isinstance(out.get(key), dict):
                out[key] = {name: visit(item) for name, item in out[key].items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False  # the keys the schema names, and then the end of the object
        elif out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"], uses_any[0] = any_ref(1), True
            out.setdefault("maxProperties", OPEN_MAX_KEYS)
        if out.get("type") == "array" and "items" not in out and "prefixItems" not in out:
            out["items"], uses_any[0] = any_ref(1), True
            out.setdefault("maxItems", OPEN_MAX_ITEMS)
        return bound_number(out)

    result = visit(schema)
    if uses_any[0] and isinstance(result, dict):
        result.setdefault("$defs", {}).update({f"{ANY_NAME}{d}": any_json(d) for d in range(1, OPEN_DEPTH + 1)})
    return result
