"""Gemma 4's tool-call argument notation -> the JSON string OpenAI's `arguments` carries.

The notation (docs/gemma4.md §13.2): objects `{key:value,...}` with bare keys (sometimes quoted),
strings between `<|"|>` delimiters (raw: braces, commas, colons, quotes and newlines inside are
text), bare numbers, `true`, `false`, `null` and arrays `[v,v]`. Bare values take the type the
tool's JSON schema gives the field; without one: true/false/null, then int, then float, else text.
"""

from __future__ import annotations

import json

QUOTE = '<|"|>'


class NotationError(ValueError):
    pass


def arguments_json(text: str, schema: dict | None) -> str:
    """The JSON text of the arguments object `text` (starting at its `{`)."""
    value, end = _value(text, 0, schema)
    if not isinstance(value, dict) or text[end:].strip():
        raise NotationError(f"not one arguments object: {text!r}")
    return json.dumps(value, ensure_ascii=False)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _value(text: str, i: int, schema: dict | None):
    i = _skip(text, i)
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise NotationError("an unterminated string")
        return text[i + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", i):
        return _object(text, i + 1, schema)
    if text.startswith("[", i):
        return _array(text, i + 1, schema)
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    return _bare(text[i:end].strip(), schema), end


def _object(text: str, i: int, schema: dict | None):
    properties = (schema or {}).get("properties") or {}
    out = {}
    i = _skip(text, i)
    while not text.startswith("}", i):
        if text.startswith(QUOTE, i):
            key, i = _value(text, i, {"type": "string"})
        else:
            colon = text.find(":", i)
            if colon < 0:
                raise NotationError("a key without a value")
            key, i = text[i:colon].strip(), colon
        i = _skip(text, i)
        if not text.startswith(":", i):
            raise NotationError(f"expected ':' after {key!r}")
        out[key], i = _value(text, i + 1, properties.get(key))
        i = _skip(text, i)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
        elif not text.startswith("}", i):
            raise NotationError("expected ',' or '}'")
    return out, i + 1


def _array(text: str, i: int, schema: dict | None):
    items = (schema or {}).get("items")
    out = []
    i = _skip(text, i)
    while not text.startswith("]", i):
        value, i = _value(text, i, items)
        out.append(value)
        i = _skip(text, i)
        if text.startswith(",", i):
            i = _skip(text, i + 1)
        elif not text.startswith("]", i):
            raise NotationError("expected ',' or ']'")
    return out, i + 1


def _bare(word: str, schema: dict | None):
    kind = (schema or {}).get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and len(kinds) == 1:
        return word
    if word in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[word]
    try:
        return int(word)
    except ValueError:
        pass
    try:
        number = float(word)
    except ValueError:
        return word
    return int(number) if "integer" in kinds and number.is_integer() else number
