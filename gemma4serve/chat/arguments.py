"""Gemma 4's tool-call argument notation -> the JSON string OpenAI's `arguments` carries, streamed.

The notation (docs/gemma4.md §13.2): objects `{key:value,...}` with bare keys (sometimes quoted),
strings between `<|"|>` delimiters (raw: braces, commas, colons, quotes and newlines inside are
text), bare numbers, `true`, `false`, `null` and arrays `[v,v]`. Bare values take the type the
tool's JSON schema gives the field; without one: true/false/null, then int, then float, else text.

`ArgumentsStream` reads the notation piece by piece and returns only JSON that can no longer change
(a string's characters as they come; a bare value, a key and the `, ` before it once they end), so
the pieces it returns concatenate to exactly the final `arguments` text.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

QUOTE = '<|"|>'
_UNITS = re.compile(re.escape(QUOTE) + "|.", re.S)  # the delimiter is one unit, else characters
_CLOSERS = {"{": "}", "(": ")", "[": "]"}


class NotationError(ValueError):
    pass


@dataclass
class _Container:
    closer: str  # "}" (or ")" for the `call:NAME(...)` form) or "]"
    schema: dict | None
    phase: str  # object: key, colon (after a quoted key), value, after; array: value, after
    members: int = 0
    key: str = ""

    @property
    def is_object(self) -> bool:
        return self.closer != "]"


class ArgumentsStream:
    """One call's arguments, fed as they arrive; `feed` returns the JSON that became final.

    Malformed notation stops the reading (`error`, and the text from there on is `rest`); `close`
    still completes the JSON, so a call always carries a JSON object."""

    def __init__(self, schema: dict | None):
        self.schema = schema
        self.stack: list[_Container] = []
        self.started = self.done = False
        self.error: str | None = None
        self._string: str | None = None  # inside <|"|>...<|"|>: "key" or "value"
        self._bare = ""  # the bare value being read
        self._separator = ""  # what goes before the pending bare value: ", " within an array
        self.rest = ""  # what followed the closed object (or the error), for the caller to take

    def feed(self, text: str) -> str:
        out = []
        for unit in _UNITS.findall(text):
            if self.done or self.error is not None:
                self.rest += unit
                continue
            try:
                if self._bare and (unit in ",]}" or unit == self.stack[-1].closer):
                    out.append(self._end_bare())  # sent even if what ends it is malformed
                out.append(self._unit(unit))
            except NotationError as e:
                self.error, self.rest = str(e), unit
        return "".join(out)

    def close(self) -> str:
        """The JSON that completes what was read (the call ended early): a pending bare value or
        a missing value, then the closers of an open string and of the open containers."""
        if self.done:
            return ""
        if not self.started:
            self.done = True
            return "{}"
        out = []
        top = self.stack[-1]
        if self._string == "value":
            out.append('"')
        elif self._bare:
            out.append(self._end_bare())
        elif top.is_object and top.phase in ("value", "colon"):
            out.append("null")  # the key was sent; its value never came
        out.extend("}" if c.is_object else "]" for c in reversed(self.stack))
        self.done = True
        return "".join(out)

    # ---- one unit: the delimiter or a character ----

    def _unit(self, unit: str) -> str:
        if not self.started:
            if unit.isspace():
                return ""
            if unit not in "{(":
                raise NotationError(f"arguments start with {unit!r}, not an object")
            self.started = True
            self.stack.append(_Container(_CLOSERS[unit], self.schema, "key"))
            return "{"
        top = self.stack[-1]
        if self._string is not None:
            return self._string_unit(unit, top)
        if self._bare:
            if unit == QUOTE:
                raise NotationError(f"a string delimiter inside the bare value {self._bare!r}")
            self._bare += unit
            return ""
        if top.is_object and top.phase == "key":
            return self._key_unit(unit, top)
        if unit.isspace():
            return ""
        if top.phase == "after":
            return self._after(unit, top)
        if top.phase == "colon":
            if unit != ":":
                raise NotationError(f"expected ':' after the key {top.key!r}")
            top.phase = "value"
            return ""
        return self._value_start(unit, top)

    def _key_unit(self, unit: str, top: _Container) -> str:
        if not top.key:
            if unit.isspace():
                return ""
            if unit == top.closer:
                return self._close()
            if unit == QUOTE:
                self._string = "key"
                return ""
        if unit == ":":
            return self._key_done(top, top.key.strip(), phase="value")
        if unit in "{}[](),":
            raise NotationError(f"{unit!r} in the key {top.key!r}")
        top.key += unit
        return ""

    def _key_done(self, top: _Container, key: str, phase: str) -> str:
        if not key:
            raise NotationError("an empty key")
        top.phase, top.key = phase, key
        separator = ", " if top.members else ""
        top.members += 1
        return separator + json.dumps(key, ensure_ascii=False) + ": "

    def _string_unit(self, unit: str, top: _Container) -> str:
        if self._string == "key":  # a quoted key: sent whole once it closes
            if unit == QUOTE:
                self._string = None
                return self._key_done(top, top.key, phase="colon")
            top.key += unit
            return ""
        if unit == QUOTE:
            self._string = None
            top.phase = "after"
            return '"'
        return json.dumps(unit, ensure_ascii=False)[1:-1]

    def _value_start(self, unit: str, top: _Container) -> str:
        if not top.is_object and unit == "]":
            return self._close()
        if unit in ",]})":
            raise NotationError(f"a value expected, not {unit!r}")
        separator = ""
        if not top.is_object:
            separator = ", " if top.members else ""
            top.members += 1
        if unit == QUOTE:
            self._string = "value"
            return separator + '"'
        if unit in "{[":
            top.phase = "after"
            child = _Container(_CLOSERS[unit], self._child_schema(top), "key")
            if unit == "[":
                child.phase = "value"
            self.stack.append(child)
            return separator + unit
        self._bare, self._separator = unit, separator
        return ""

    def _after(self, unit: str, top: _Container) -> str:
        if unit == top.closer:
            return self._close()
        if unit == ",":
            top.phase, top.key = ("key" if top.is_object else "value"), ""
            return ""
        if unit.isspace():
            return ""
        raise NotationError(f"expected ',' or {top.closer!r}, not {unit!r}")

    def _close(self) -> str:
        container = self.stack.pop()
        self.done = not self.stack
        return "}" if container.is_object else "]"

    def _child_schema(self, top: _Container) -> dict | None:
        schema = top.schema or {}
        if top.is_object:
            return (schema.get("properties") or {}).get(top.key)
        return schema.get("items")

    def _end_bare(self) -> str:
        """The JSON of the bare value just read, typed by its field's schema."""
        top = self.stack[-1]
        value = bare_value(self._bare.strip(), self._child_schema(top))
        text = self._separator + json.dumps(value, ensure_ascii=False)
        self._bare, self._separator = "", ""
        top.phase = "after"
        return text


def bare_value(word: str, schema: dict | None):
    """A bare word typed by its field's schema (a `string` field keeps `3` as "3")."""
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
    if not math.isfinite(number):  # JSON has no nan or inf
        return word
    return int(number) if "integer" in kinds and number.is_integer() else number


def arguments_json(text: str, schema: dict | None) -> str:
    """The JSON text of the arguments object `text` (starting at its `{`); strict."""
    stream = ArgumentsStream(schema)
    out = stream.feed(text)
    if stream.error is not None or not stream.done or stream.rest.strip():
        raise NotationError(stream.error or f"not one arguments object: {text!r}")
    return out
