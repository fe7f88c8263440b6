"""EBNF (xgrammar's dialect) for Gemma 4's tool calls, `<|tool_call>call:NAME{ARGS}<tool_call|>`,
whose arguments follow the tool's JSON schema in Gemma's notation (docs/gemma4.md §13.2), and for
the thought channel that may precede a constrained output.

The marker tokens are `Token(id)` elements: only the special token itself matches them, never
its text spelt by other tokens. Free text (a string's characters, thinking) is xgrammar's
`TagDispatch` with every special token's text excluded, so the output parser, which reads the
text, finds no marker inside it.

Supported schema keywords: type (object, array, string, number, integer, boolean, null, or a
list of them), properties, required, additionalProperties (an object with properties takes only
those; one without takes any keys), items, minItems, maxItems, enum, const, anyOf/oneOf, and:
- minimum, maximum, exclusiveMinimum, exclusiveMaximum (numbers): exact for integers; a bounded
  number is a decimal without an exponent, exact over decimals of at most 12 fraction digits,
  every one inside the bounds when read as a float (ranges.py);
- minLength, maxLength (characters): such a string holds no `<`;
- pattern: the whole string matches it, holding no `<` (pattern.py); not with minLength or
  maxLength, which cannot both be enforced (a 400).
Bounds that no value meets (minimum > maximum, minLength > maxLength) are a 400. Others ($ref,
multipleOf, ...) are not enforced: a node whose type the grammar cannot tell takes any value, and
so does an enum's or a const's value.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from gemma4serve.structured import ranges
from gemma4serve.structured.pattern import pattern_rules
from gemma4serve.structured.spec import IN_THOUGHT, NO_THINKING
from gemma4serve.validation import RequestError

# Keys the model writes bare (the chat template writes them so); others are quoted.
_BARE_KEY = re.compile(r"[^\s:{}\[\](),<>]([^:{}\[\](),<>]*[^\s:{}\[\](),<>])?")
# A call head the output parser reads (chat/output.py CALL_HEAD).
_CALL_NAME = re.compile(r"[A-Za-z_][\w.\-]*")

# The values every grammar shares. Numbers have bounded digits so that every one a grammar allows
# converts to a finite JSON number (a float of 400 digits would be inf).
_COMMON = r"""
int ::= "-"? ("0" | [1-9] [0-9]{0,15})
num ::= int ("." [0-9]{1,16})? ([eE] [+-]? [0-9]{1,2})?
bool ::= "true" | "false"
null ::= "null"
str ::= quote text quote
any ::= str | num | bool | null | any_obj | any_arr
any_obj ::= "{" (any_member ("," any_member)*)? "}"
any_member ::= any_key ":" any
any_key ::= [A-Za-z_] [A-Za-z0-9_]*
any_arr ::= "[" (any ("," any)*)? "]"
"""


@dataclass(frozen=True)
class MarkerTokens:
    """The special tokens the grammars write, by id, and every special token's text."""

    call_open: int
    call_close: int
    quote: int
    channel_open: int
    channel_close: int
    specials: tuple[str, ...]

    def text_rule(self, name: str) -> str:
        """Any text holding no special token's text."""
        excludes = ", ".join(_literal(text) for text in self.specials)
        return f"{name} ::= TagDispatch(loop_after_dispatch=false, excludes=({excludes}))\n"


def thinking_rules(markers: MarkerTokens, thinking: str) -> tuple[str, str]:
    """(the rules, the expression that goes before the constrained part) for the spec's
    `thinking`: none, an optional thought channel, or the rest of one the prompt opened."""
    if thinking == NO_THINKING:
        return "", ""
    rules = markers.text_rule("thought_text")
    close = f"thought_text Token({markers.channel_close})"
    if thinking == IN_THOUGHT:
        return rules, close
    return rules, f"(Token({markers.channel_open}) {close})?"


def tool_calls_ebnf(tools: list[dict], parallel: bool, markers: MarkerTokens, prefix: str) -> str:
    """The grammar of one call (or, parallel, one or more calls) to any of `tools`
    ([{"name", "parameters"}]), after `prefix` (an EBNF expression, may be empty)."""
    builder = _Builder(markers)
    alternatives = []
    for tool in tools:
        name = tool["name"]
        if not isinstance(name, str) or not _CALL_NAME.fullmatch(name):
            raise RequestError(
                f"the tool name {name!r} cannot be written in Gemma's call notation",
                param="tool_choice",
            )
        parameters = tool.get("parameters")
        # no parameters: the call takes `{}` (vLLM's default schema for such a tool)
        if not isinstance(parameters, dict) or not parameters:
            parameters = {"properties": {}}
        arguments = builder.object_rule(parameters)
        alternatives.append(f"{_literal(name)} {arguments}")
    calls = "call+" if parallel else "call"
    head = (
        f"root ::= {prefix} {calls}\n"
        f'call ::= Token({markers.call_open}) "call:" ({" | ".join(alternatives)}) '
        f"Token({markers.call_close})\n"
        f"quote ::= Token({markers.quote})\n"
    )
    return head + _COMMON + markers.text_rule("text") + "".join(builder.rules)


@dataclass
class _Builder:
    """Rules for schema nodes, one per node, named v0, v1, ..."""

    markers: MarkerTokens
    rules: list[str] = field(default_factory=list)

    def _rule(self, body: str) -> str:
        name = f"v{len(self.rules)}"
        self.rules.append(f"{name} ::= {body}\n")
        return name

    def value(self, schema) -> str:
        """An expression for a value that satisfies `schema`."""
        if not isinstance(schema, dict):
            return "any"  # true / absent: anything
        if "const" in schema:
            return self._constant(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(self._constant(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                merged = [{**_without(schema, key), **branch} for branch in schema[key]]
                return "(" + " | ".join(self.value(branch) for branch in merged) + ")"
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return "(" + " | ".join(self.value({**schema, "type": one}) for one in kind) + ")"
        if kind == "string":
            return self._string(schema)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return "bool"
        if kind == "null":
            return "null"
        if kind == "array":
            return self._array(schema)
        if kind == "object" or "properties" in schema:
            return self.object_rule(schema)
        return "any"

    def _array(self, schema: dict) -> str:
        least, most = schema.get("minItems", 0), schema.get("maxItems")
        least = least if isinstance(least, int) and least > 0 else 0
        most = most if isinstance(most, int) and most >= least else None
        if most == 0:
            return '("[" "]")'
        item = self.value(schema.get("items"))
        more = f"{{{max(least - 1, 0)},{'' if most is None else most - 1}}}"
        items = f'{item} ("," {item}){more}'
        return self._rule(f'"[" {items} "]"' if least else f'"[" ({items})? "]"')

    def object_rule(self, schema: dict) -> str:
        """Declared properties, in the chat template's order (sorted, ignoring case), the
        required ones present; an object without `properties` takes any members."""
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return "any_obj"
        required = {key for key in schema.get("required") or () if isinstance(key, str)}
        # a required key the properties do not declare takes any value
        properties = {**{key: {} for key in required}, **properties}
        keys = sorted(properties, key=str.lower)
        members = [f'{self._key(key)} ":" {self.value(properties[key])}' for key in keys]
        # rest(i, first): the members from i on, `first` when none was written before them
        rest = {(len(keys), True): '""', (len(keys), False): '""'}
        for i in range(len(keys) - 1, -1, -1):
            for first in (True, False):
                comma = "" if first else '"," '
                written = f"{comma}{members[i]} {rest[(i + 1, False)]}"
                body = written if keys[i] in required else f"{written} | {rest[(i + 1, first)]}"
                rest[(i, first)] = self._rule(body)
        return self._rule(f'"{{" {rest[(0, True)]} "}}"')

    def _key(self, key: str) -> str:
        self._check_text(key)
        if _BARE_KEY.fullmatch(key):
            return _literal(key)
        return f"quote {_literal(key)} quote"

    def _string(self, schema: dict) -> str:
        least, most = _count(schema, "minLength"), _count(schema, "maxLength")
        if least is not None and most is not None and least > most:
            raise RequestError(
                f"minLength {least} > maxLength {most}: no string fits", param="tools"
            )
        pattern = schema.get("pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise RequestError(f"pattern {pattern!r} is not a string", param="tools")
            if least is not None or most is not None:
                raise RequestError(
                    "pattern with minLength or maxLength cannot be enforced together", param="tools"
                )
            rules, root = pattern_rules(pattern, f"re{len(self.rules)}")
            self.rules.append(rules)
            return f"(quote {root} quote)"
        if not least and most is None:
            return "str"  # minLength 0 bounds nothing
        # Counted in characters (xgrammar's max_chars counts bytes of a broken UTF-8 sequence
        # loosely); no `<`, so no special token's text.
        return f"(quote [^<]{{{least or 0},{'' if most is None else most}}} quote)"

    def _integer(self, schema: dict) -> str:
        bounds = _tightest(
            schema, ranges.integer_at_least, ranges.integer_at_most, ranges.LARGEST_INTEGER
        )
        if bounds is None:
            return "int"
        least, most = bounds
        least, most = max(least, -ranges.LARGEST_INTEGER), min(most, ranges.LARGEST_INTEGER)
        if least > most:
            raise RequestError(
                f"no integer of at most {ranges.DIGITS} digits meets {_bounds_text(schema)}",
                param="tools",
            )
        return ranges.integers(least, most)

    def _number(self, schema: dict) -> str:
        bounds = _tightest(
            schema, ranges.decimal_at_least, ranges.decimal_at_most, ranges.LARGEST_DECIMAL
        )
        if bounds is None:
            return "num"
        least, most = bounds
        if least > most:
            raise RequestError(
                f"no number of at most {ranges.DIGITS} integer and {ranges.FRACTION_DIGITS} "
                f"fraction digits meets "
                f"{_bounds_text(schema)}",
                param="tools",
            )
        return ranges.decimals(least, most)

    def _constant(self, value) -> str:
        """A JSON value as the model writes it in the notation."""
        if isinstance(value, str):
            self._check_text(value)
            return f"(quote {_literal(value)} quote)" if value else "(quote quote)"
        if isinstance(value, bool) or value is None:
            return _literal(json.dumps(value))
        if isinstance(value, (int, float)):
            return _literal(json.dumps(value))
        if isinstance(value, list):
            items = ' "," '.join(self._constant(v) for v in value)
            return f'("[" {items} "]")'
        if isinstance(value, dict):
            keys = sorted(value, key=str.lower)
            members = ' "," '.join(f'{self._key(k)} ":" {self._constant(value[k])}' for k in keys)
            return f'("{{" {members} "}}")'
        return "any"

    def _check_text(self, text: str) -> None:
        if any(special in text for special in self.markers.specials):
            raise RequestError(
                f"{text!r} holds a special token's text: no call can write it", param="tools"
            )


_LOWER = {"minimum": False, "exclusiveMinimum": True}  # keyword: whether it is exclusive
_UPPER = {"maximum": False, "exclusiveMaximum": True}


def _tightest(schema: dict, at_least, at_most, largest):
    """(least, most) a number schema's bounds allow, each side the tightest of its keywords and
    +-`largest` where it has none; None for a schema with no bound."""
    lower, upper = _bounds(schema)
    if not lower and not upper:
        return None
    least = max([at_least(v, exclusive) for v, exclusive in lower], default=-largest)
    most = min([at_most(v, exclusive) for v, exclusive in upper], default=largest)
    return least, most


def _bounds(schema: dict) -> tuple[list[tuple[float, bool]], list[tuple[float, bool]]]:
    """(lower, upper) bounds, each (value, exclusive), of a number schema."""
    found = []
    for keywords in (_LOWER, _UPPER):
        bounds = []
        for keyword, exclusive in keywords.items():
            value = schema.get(keyword)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{keyword} {value!r} is not a number", param="tools")
            if isinstance(value, float) and not math.isfinite(value):
                raise RequestError(f"{keyword} {value!r} is not a finite number", param="tools")
            bounds.append((value, exclusive))
        found.append(bounds)
    return found[0], found[1]


def _bounds_text(schema: dict) -> str:
    keys = [*_LOWER, *_UPPER]
    return ", ".join(f"{key} {schema[key]}" for key in keys if schema.get(key) is not None)


def _count(schema: dict, keyword: str) -> int | None:
    """A non-negative integer keyword (minLength, maxLength), or None when absent."""
    value = schema.get(keyword)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(f"{keyword} {value!r} is not a non-negative integer", param="tools")
    return value


def _without(schema: dict, key: str) -> dict:
    return {k: v for k, v in schema.items() if k != key}


def _literal(text: str) -> str:
    """An EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text, ensure_ascii=False)
