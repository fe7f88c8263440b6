"""What a Gemma 4 chat completion wrote, split into reasoning, content and tool calls.

The model writes (docs/gemma4.md §13.1): `<|channel>thought\\n` REASONING `<channel|>` for its
thinking, `<|tool_call>call:NAME{ARGS}<tool_call|>` for each tool call, and plain text for the
answer. The engine detokenizes a parsed chat choice with its special tokens kept, so each one
arrives whole in the text; one parser per choice turns the text, delta by delta, into OpenAI's
fields (§13.3): several markers may arrive in one delta (MTP commits several tokens per step),
reasoning loses its `thought` label, whitespace before a call is not content, and a call is sent
whole (name and complete arguments) once it closes, so its arguments never change after they are
sent.
"""

from __future__ import annotations

import functools
import re
import uuid
from dataclasses import dataclass, field

from gemma4serve.server.tool_arguments import QUOTE, NotationError, arguments_json

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TURN_OPEN = "<|turn>"
LABEL = "thought\n"  # the channel's label, not reasoning text
# A call's head: `call:NAME{`, also the malformed `:NAME{`, `NAME{` and `call:NAME(...)`.
CALL_HEAD = re.compile(r"\s*(?:call)?:?\s*([A-Za-z_][\w.\-]*)\s*([({].*)", re.S)


@dataclass(frozen=True)
class ChatMarkers:
    """The checkpoint's special-token texts, found in its tokenizer (never by hard-coded ids)."""

    specials: tuple[str, ...]  # every special token's text, longest first
    channel_open_id: int
    channel_close_id: int
    turn_open_id: int | None

    @classmethod
    def from_tokenizer(cls, tokenizer) -> ChatMarkers | None:
        """None when the tokenizer lacks Gemma 4's channel and tool-call tokens."""
        if tokenizer is None:
            return None
        ids = {text: tokenizer.token_to_id(text) for text in (CHANNEL_OPEN, CHANNEL_CLOSE)}
        calls = [tokenizer.token_to_id(text) for text in (CALL_OPEN, CALL_CLOSE, QUOTE)]
        if None in ids.values() or None in calls:
            return None
        texts = {tokenizer.id_to_token(i) for i in tokenizer.all_special_ids}
        specials = tuple(sorted(texts, key=len, reverse=True))
        turn_open = tokenizer.token_to_id(TURN_OPEN)
        return cls(specials, ids[CHANNEL_OPEN], ids[CHANNEL_CLOSE], turn_open)

    @functools.cached_property
    def splitter(self) -> re.Pattern:
        """Splits text into plain runs and special tokens (odd items), compiled once."""
        return re.compile("(" + "|".join(map(re.escape, self.specials)) + ")")

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves a thought channel open (the completion begins inside it):
        a `<|channel>` after the last turn opener with no `<channel|>` after it."""
        last_turn = max((i for i, t in enumerate(prompt_ids) if t == self.turn_open_id), default=-1)
        tail = prompt_ids[last_turn + 1 :]
        opened = max((i for i, t in enumerate(tail) if t == self.channel_open_id), default=-1)
        closed = max((i for i, t in enumerate(tail) if t == self.channel_close_id), default=-1)
        return opened > closed


@dataclass
class ToolCall:
    index: int  # within the choice: 0, 1, ...
    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass
class ChatDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self


class ChatOutputParser:
    """One choice's text, fed delta by delta; each `feed` returns what became final."""

    def __init__(self, markers: ChatMarkers, tool_schemas: dict[str, dict], in_reasoning: bool):
        self.tool_schemas = tool_schemas
        self._split = markers.splitter
        self.state = "reasoning" if in_reasoning else "content"
        self._label = in_reasoning  # the next reasoning text may start with the label
        self._held = ""  # text not final yet: a partial label, or trailing content whitespace
        self._call = ""  # the open call's text
        self._content_started = False
        self.num_calls = 0

    def feed(self, text: str) -> ChatDelta:
        delta = ChatDelta()
        for i, part in enumerate(self._split.split(text)):
            if i % 2 == 0:
                delta += self._text(part)
            else:
                delta += self._marker(part)
        return delta

    def finish(self) -> ChatDelta:
        """The end of the choice: trailing whitespace is dropped, a held start of an answer is
        content after all, and an unclosed call is content (nothing the model wrote is lost)."""
        delta = ChatDelta()
        if self.state == "call":
            delta.content = self._call.replace(QUOTE, '"')
        elif self.state == "content" and self._held.strip():
            delta.content = self._held
        self._held, self._call, self.state = "", "", "content"
        return delta

    def _marker(self, marker: str) -> ChatDelta:
        delta = ChatDelta()
        if marker == CHANNEL_OPEN and self.state == "content":
            self._held, self.state, self._label = "", "reasoning", True
        elif marker == CHANNEL_CLOSE and self.state == "reasoning":
            self._held, self.state = "", "content"  # what is held is (part of) the label
        elif marker == CALL_OPEN:
            if self.state == "call":
                delta += self._close_call()
            self._held, self._call, self.state = "", "", "call"  # a call also ends reasoning
        elif marker == CALL_CLOSE and self.state == "call":
            delta += self._close_call()
        elif marker == QUOTE and self.state == "call":
            self._call += QUOTE  # the notation's string delimiter
        return delta  # any other special token (or a stray marker) is not text

    def _text(self, text: str) -> ChatDelta:
        if not text:
            return ChatDelta()
        if self.state == "call":
            self._call += text
            return ChatDelta()
        text, self._held = self._held + text, ""
        if self.state == "reasoning":
            if self._label:
                if LABEL.startswith(text):  # maybe the label, split over deltas
                    self._held = text
                    return ChatDelta()
                self._label = False
                text = text.removeprefix(LABEL)
            return ChatDelta(reasoning=text)
        if not self._content_started:  # a bare label the model may write with thinking off
            if LABEL.startswith(text):
                self._held = text
                return ChatDelta()
            text = text.removeprefix(LABEL)
        final = text.rstrip()
        self._held = text[len(final) :]  # whitespace before a call is not content
        self._content_started = self._content_started or bool(final)
        return ChatDelta(content=final)

    def _close_call(self) -> ChatDelta:
        text, self._call, self.state = self._call, "", "content"
        head = CALL_HEAD.fullmatch(text)
        if head is not None:
            name, arguments = head.group(1), head.group(2).strip()
            if arguments.startswith("(") and arguments.endswith(")"):
                arguments = "{" + arguments[1:-1] + "}"
            try:
                arguments = arguments_json(arguments, self.tool_schemas.get(name))
            except NotationError:
                head = None
        if head is None:  # not a call after all: keep its text
            return ChatDelta(content=text.replace(QUOTE, '"'))
        self._held = ""
        call = ToolCall(self.num_calls, f"chatcmpl-tool-{uuid.uuid4().hex}", name, arguments)
        self.num_calls += 1
        return ChatDelta(tool_calls=[call])
