"""Structured output with xgrammar: a request's grammar spec, its compilation, and the per-sequence
matcher that fills token bitmasks (docs/performance.md says why xgrammar).

The spec is plain data (picklable) so it crosses a process boundary; matchers live beside the
engine's sequences and see only committed tokens (drafts are tried on a rollback-able path).
"""

from __future__ import annotations

import functools
import json

import torch
import xgrammar

from gemma4serve.structured.notation import MarkerTokens, thinking_rules, tool_calls_ebnf
from gemma4serve.structured.spec import NO_THINKING, StructuredOutputsParams
from gemma4serve.structured.unenforced import refuse_unenforced
from gemma4serve.tokenizer import Tokenizer
from gemma4serve.validation import RequestError

# JSON whitespace runs are bounded so a model cannot fill max_tokens with indentation.
MAX_WHITESPACE = 4
_LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
_STRICT_STRING_CHARACTER = r"[^\0-\x1f\"\\]"
# The special tokens tool-call and thinking grammars write (docs/gemma4.md §13).
MARKER_TEXTS = ("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")


class GrammarCompiler:
    """Compiles specs against one tokenizer; compiled grammars are cached by spec."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._compiler = xgrammar.GrammarCompiler(self._info(marker_ids=()))
        self._markers: MarkerTokens | None = None
        self._marker_compiler: xgrammar.GrammarCompiler | None = None  # made on first use
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def _info(self, marker_ids: tuple[int, ...]) -> xgrammar.TokenizerInfo:
        """Special tokens are "" (xgrammar never allows those: their text is not the output's
        text), except the markers a grammar names by id: their bytes start with 0xFF, never
        valid UTF-8, so no character class, `.` or free text of any grammar can take them."""
        tokenizer = self._tokenizer
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        special = set(tokenizer.all_special_ids)
        encoded = [""] * self.vocab_size
        for text, token_id in vocab.items():
            if token_id < self.vocab_size and token_id not in special:
                encoded[token_id] = text
            elif token_id in marker_ids:
                encoded[token_id] = b"\xff" + text.encode()
        return xgrammar.TokenizerInfo(
            encoded,
            _vocab_type(tokenizer),
            vocab_size=self.vocab_size,
            stop_token_ids=self._stop_token_ids,
        )

    def _marker_tokens(self) -> tuple[MarkerTokens, xgrammar.GrammarCompiler]:
        """The markers' ids and a compiler whose vocabulary lets Token(id) name them."""
        if self._marker_compiler is None:
            tokenizer = self._tokenizer
            ids = [tokenizer.token_to_id(text) for text in MARKER_TEXTS]
            if None in ids or max(ids) >= self.vocab_size:
                raise RequestError(
                    "this tokenizer lacks Gemma 4's tool-call and channel tokens, which "
                    "tool_choice and thinking grammars need"
                )
            texts = {tokenizer.id_to_token(i) for i in tokenizer.all_special_ids} | set(
                MARKER_TEXTS
            )
            self._markers = MarkerTokens(*ids, specials=tuple(sorted(texts)))
            self._marker_compiler = xgrammar.GrammarCompiler(self._info(tuple(ids)))
        return self._markers, self._marker_compiler

    def _compile_uncached(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        if spec.tool_calls is not None:
            markers, compiler = self._marker_tokens()
            rules, prefix = thinking_rules(markers, spec.thinking)
            tools = json.loads(spec.tool_calls)
            ebnf = tool_calls_ebnf(tools, spec.parallel_tool_calls, markers, prefix) + rules
            return compiler.compile_grammar(xgrammar.Grammar.from_ebnf(ebnf))
        grammar = self._answer_grammar(spec)
        if spec.regex is not None or spec.grammar is not None:  # a user's language may be empty
            _refuse_empty(self._compiler.compile_grammar(grammar), self.vocab_size)
        if spec.thinking == NO_THINKING:  # xgrammar's own cache: not compiled a second time
            return self._compiler.compile_grammar(grammar)
        # Thinking first: the answer's grammar applies once the thought channel closes.
        markers, compiler = self._marker_tokens()
        rules, prefix = thinking_rules(markers, spec.thinking)
        thinking = xgrammar.Grammar.from_ebnf(f'root ::= {prefix} ""\n' + rules)
        return compiler.compile_grammar(xgrammar.Grammar.concat(thinking, grammar))

    def _answer_grammar(self, spec: StructuredOutputsParams) -> xgrammar.Grammar:
        if spec.regex is not None:
            return xgrammar.Grammar.from_regex(spec.regex)
        if spec.choice is not None:  # JSON's string escapes are the EBNF literals' too
            literals = (json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
            return xgrammar.Grammar.from_ebnf("root ::= " + " | ".join(literals))
        if spec.grammar is not None:
            return xgrammar.Grammar.from_ebnf(spec.grammar)
        return self._json_grammar(spec)

    def _json_grammar(self, spec: StructuredOutputsParams) -> xgrammar.Grammar:
        # json_object: any JSON object, with the same bounded whitespace and strict strings.
        schema = spec.json if spec.json is not None else '{"type": "object"}'
        if spec.any_whitespace:
            grammar = xgrammar.Grammar.from_json_schema(
                schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE
            )
        else:  # compact: no space after "," and ":" either, as vLLM asks xgrammar
            grammar = xgrammar.Grammar.from_json_schema(
                schema, any_whitespace=False, separators=(",", ":")
            )
        # xgrammar's length-bounded strings let raw control characters through (strict JSON
        # forbids U+0000-U+001F inside strings): its unbounded strings' class is used instead.
        text = str(grammar).replace(_LOOSE_STRING_CHARACTER, _STRICT_STRING_CHARACTER)
        return xgrammar.Grammar.from_ebnf(text)

    def matcher(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one sequence; RequestError names a schema it cannot compile."""
        if spec.json is not None:
            try:
                schema = json.loads(spec.json)
            except ValueError as error:
                raise RequestError(
                    f"the JSON schema is not valid JSON: {error}", param="response_format"
                ) from error
            refuse_unenforced(schema)
        try:
            compiled = self._compile(spec)
        except RequestError:
            raise
        except (RuntimeError, ValueError) as error:
            if spec.tool_calls is not None:
                what, param = "the tools' schemas", "tools"
            elif spec.regex is not None or spec.grammar is not None or spec.choice is not None:
                what = "the regex" if spec.regex else "the grammar" if spec.grammar else "choice"
                param = "structured_outputs"
            else:
                what, param = "the JSON schema", "response_format"
            raise RequestError(f"{what} cannot be used: {error}", param=param) from error
        return GrammarState(xgrammar.GrammarMatcher(compiled), self.vocab_size)


class GrammarState:
    """One sequence's position in its grammar: advanced by committed tokens only."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def commit(self, token: int) -> None:
        """Advance by an emitted token (emitted tokens were chosen under this grammar's mask)."""
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Fill bitmask rows first_row .. first_row + len(drafts): row j allows what may follow
        the committed tokens plus drafts[:j]. Rows past the first draft the grammar rejects are
        never reached (the row before cannot choose that draft) and keep the previous row's
        mask."""
        matcher = self.matcher
        self._fill(bitmask, first_row)
        advanced = 0
        for j, draft in enumerate(drafts, start=1):
            row = first_row + j - 1
            allowed = (int(bitmask[row, draft // 32]) >> (draft % 32)) & 1
            if matcher.is_terminated() or not allowed or not matcher.accept_token(draft):
                bitmask[first_row + j : first_row + len(drafts) + 1] = bitmask[first_row + j - 1]
                break
            advanced += 1
            self._fill(bitmask, first_row + j)
        if advanced:
            matcher.rollback(advanced)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():
            # Ended by a stop token: nothing of this row is used; leave everything allowed.
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


def _refuse_empty(compiled: xgrammar.CompiledGrammar, vocab_size: int) -> None:
    """A grammar no text matches would mask every token (the sampler would then emit token 0)."""
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    if not matcher.is_terminated() and not bitmask.any():
        raise RequestError("the constraint matches no text", param="structured_outputs")


def _vocab_type(tokenizer: Tokenizer) -> xgrammar.VocabType:
    """How token strings spell bytes: Gemma's `▁` words with `<0xNN>` byte tokens, GPT-2's
    byte-level alphabet, or raw text."""
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    kinds = json.dumps(decoder)
    if "ByteFallback" in kinds:
        return xgrammar.VocabType.BYTE_FALLBACK
    if "ByteLevel" in kinds:
        return xgrammar.VocabType.BYTE_LEVEL
    return xgrammar.VocabType.RAW
