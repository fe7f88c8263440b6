"""EBNF (xgrammar's dialect) for the strings a JSON schema `pattern` matches, none holding `<`
(every special token's text holds one, so no string spells a special token).

xgrammar converts the regex (the whole string matches it, as xgrammar reads `pattern`: a
stricter reading than JSON Schema's search, so every string written also satisfies it); each
character class of the result then loses `<`, and a pattern with a literal `<` (or a class of
`<` alone) is refused.
"""

from __future__ import annotations

import re

import xgrammar

from gemma4serve.validation import RequestError

_BANNED = ord("<")
# xgrammar's error text starts with a log head: `[12:00:00] /path/file.cc:83: `
_LOG_HEAD = re.compile(r"^\[[^\]]*\] \S+: ")
# An EBNF token of xgrammar's printed grammars: a string literal, a character class, a name.
_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][A-Za-z0-9_]*', re.S)
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.S)
_ESCAPE_OR_CHARACTER = re.compile(_ESCAPE.pattern + "|.", re.S)
_NAMED_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0"}


def pattern_rules(pattern: str, prefix: str) -> tuple[str, str]:
    """(the rules, each name starting with `prefix`; the name of the rule for the whole string)."""
    try:
        printed = str(xgrammar.Grammar.from_regex(pattern))
    except (RuntimeError, ValueError) as error:
        reason = _LOG_HEAD.sub("", str(error)).strip()
        raise RequestError(
            f"the pattern {pattern!r} cannot be used: {reason}", param="tools"
        ) from error
    names = {line.split("::=")[0].strip() for line in printed.splitlines() if "::=" in line}

    def rewrite(token: re.Match) -> str:
        text = token.group()
        if text in names:
            return f"{prefix}_{text}"
        if text.startswith('"'):
            if "<" in _unescape(text[1:-1]):
                raise RequestError(
                    f"the pattern {pattern!r} writes `<`, which no string may hold", param="tools"
                )
            return text
        if text.startswith("["):
            return _class_without_banned(text, pattern)
        return text

    return _TOKEN.sub(rewrite, printed), f"{prefix}_root"


def _class_without_banned(text: str, pattern: str) -> str:
    """A printed character class, `[...]` or `[^...]`, less `<`."""
    negated = text.startswith("[^")
    # (character, whether escaped): an escaped `-` is a character, not a range's dash
    items = [
        (_unescape(piece.group()), piece.group().startswith("\\"))
        for piece in _ESCAPE_OR_CHARACTER.finditer(text[2 if negated else 1 : -1])
    ]
    ranges, i = [], 0
    while i < len(items):
        if i + 2 < len(items) and items[i + 1] == ("-", False):
            ranges.append((ord(items[i][0]), ord(items[i + 2][0])))
            i += 3
        else:
            ranges.append((ord(items[i][0]), ord(items[i][0])))
            i += 1
    if negated:
        ranges.append((_BANNED, _BANNED))
    else:
        ranges = [
            piece
            for low, high in ranges
            for piece in ((low, min(high, _BANNED - 1)), (max(low, _BANNED + 1), high))
            if piece[0] <= piece[1]
        ]
        if not ranges:
            raise RequestError(
                f"the pattern {pattern!r} writes `<`, which no string may hold", param="tools"
            )
    spelled = "".join(
        _spell(low) if low == high else f"{_spell(low)}-{_spell(high)}" for low, high in ranges
    )
    return f"[^{spelled}]" if negated else f"[{spelled}]"


def _unescape(text: str) -> str:
    """The characters a printed literal's (or class item's) escapes spell."""

    def one(escape: re.Match) -> str:
        code = escape.group(1)
        if len(code) > 1:
            return chr(int(code[1:], 16))
        return _NAMED_ESCAPES.get(code, code)

    return _ESCAPE.sub(one, text)


def _spell(code: int) -> str:
    """A character as a class writes it: letters and digits as they are, others escaped."""
    character = chr(code)
    return character if character.isascii() and character.isalnum() else f"\\U{code:08x}"
