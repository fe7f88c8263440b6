"""JSON-schema keywords that xgrammar's converter (0.2.8) silently fails to enforce, refused with a
400 rather than let through: a `pattern` beside minLength/maxLength (it drops the lengths), and a
number range holding no decimal of at most 6 fraction digits (the only numbers it writes; it
writes nothing there, an invalid JSON document)."""

from __future__ import annotations

import math
from decimal import Decimal

from gemma4serve.validation import RequestError

XGRAMMAR_FRACTION_DIGITS = 6
# Keywords whose value maps names to schemas, and keywords whose value is data, not a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples")


def refuse_unenforced(schema: object) -> None:
    """Raise RequestError (param response_format) at the first node xgrammar would not enforce."""
    if isinstance(schema, list):
        for item in schema:
            refuse_unenforced(item)
        return
    if not isinstance(schema, dict):
        return
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise RequestError(
            "pattern with minLength or maxLength cannot be enforced together",
            param="response_format",
        )
    if _writes_no_number(schema):
        raise RequestError(
            f"no number of at most {XGRAMMAR_FRACTION_DIGITS} fraction digits lies within the "
            "bounds of a number schema",
            param="response_format",
        )
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            refuse_unenforced(list(value.values()))
        elif key not in _DATA:
            refuse_unenforced(value)


def _writes_no_number(schema: dict) -> bool:
    """A number schema bounded on both sides with no decimal xgrammar writes in between (an empty
    range itself is xgrammar's own error)."""
    kinds = schema.get("type")
    if "number" not in (kinds if isinstance(kinds, list) else [kinds]):
        return False
    lower = _bound(schema, "minimum", "exclusiveMinimum")
    upper = _bound(schema, "maximum", "exclusiveMaximum")
    if lower is None or upper is None:
        return False
    (least, least_open), (most, most_open) = lower, upper
    if least > most or (least == most and (least_open or most_open)):
        return False
    scale = Decimal(10) ** XGRAMMAR_FRACTION_DIGITS
    # the least and greatest multiples of 10^-6 inside the bounds
    first = math.floor(least * scale) + 1 if least_open else math.ceil(least * scale)
    last = math.ceil(most * scale) - 1 if most_open else math.floor(most * scale)
    return first > last


def _bound(schema: dict, inclusive: str, exclusive: str) -> tuple[Decimal, bool] | None:
    """(the exact bound, whether it is exclusive) of a keyword pair; the tighter of the two."""
    found = [
        (Decimal(schema[key]), key == exclusive)
        for key in (inclusive, exclusive)
        if isinstance(schema.get(key), (int, float)) and not isinstance(schema[key], bool)
    ]
    found = [(value, is_open) for value, is_open in found if value.is_finite()]
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    (a, _), (b, _) = found
    tighter = max if inclusive == "minimum" else min
    return found[0] if tighter(a, b) == a and a != b else found[1]
