"""What a Gemma 4 chat completion wrote, split into reasoning, content and tool calls.

The model writes (docs/gemma4.md §13.1): `<|channel>thought\\n` REASONING `<channel|>` for its
thinking, `<|tool_call>call:NAME{ARGS}<tool_call|>` for each tool call, and plain text for the
answer. A choice is detokenized with its special tokens kept, and one parser per choice turns the
text, delta by delta, into OpenAI's fields (§13.3). It reads the text in order, so several markers
in one delta (MTP commits several tokens per step) come out in order, and what it returns never
changes afterwards: reasoning loses its `thought` label, whitespace before a call is not content,
a call's first delta carries its name and later ones pieces of its JSON arguments that concatenate
to the final text. Text that may still turn out to be something else (the start of a special
token, of the label, of a bare `call:NAME{`) is held until it is known.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import uuid
from dataclasses import dataclass, field

from gemma4serve.chat.arguments import QUOTE, ArgumentsStream
from gemma4serve.structured.spec import (
    IN_THOUGHT,
    MAY_THINK,
    NO_THINKING,
    StructuredOutputsParams,
)

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TURN_OPEN = "<|turn>"
LABEL = "thought\n"  # the channel's label, not reasoning text
# A call's head after `<|tool_call>`: `call:NAME{`, also the malformed `:NAME{`, `NAME{` and
# `call:NAME(`.
CALL_HEAD = re.compile(r"\s*(?:call\s*:|:)?\s*([A-Za-z_][\w.\-]*)\s*[({]")
HEAD_CHARS = re.compile(r"[\s\w.:\-]{0,200}")  # what a head may hold before its bracket


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
        """Finds the special tokens in text, compiled once."""
        return re.compile("|".join(map(re.escape, self.specials)))

    @functools.cached_property
    def _starts(self) -> frozenset[str]:
        """Every proper start of a special token."""
        return frozenset(text[:i] for text in self.specials for i in range(1, len(text)))

    def partial_length(self, text: str) -> int:
        """The length of the longest end of `text` that may be the start of a special token."""
        longest = min(len(text), len(self.specials[0]) - 1)  # specials are longest first
        return next((n for n in range(longest, 0, -1) if text[-n:] in self._starts), 0)

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves a thought channel open (the completion begins inside it):
        a `<|channel>` after the last turn opener with no `<channel|>` after it."""
        last_turn = max((i for i, t in enumerate(prompt_ids) if t == self.turn_open_id), default=-1)
        tail = prompt_ids[last_turn + 1 :]
        opened = max((i for i, t in enumerate(tail) if t == self.channel_open_id), default=-1)
        closed = max((i for i, t in enumerate(tail) if t == self.channel_close_id), default=-1)
        return opened > closed

    def after_thinking(
        self,
        spec: StructuredOutputsParams | None,
        prompt_ids: list[int],
        chat_template_kwargs: dict | None,
    ) -> StructuredOutputsParams | None:
        """`spec` starting where the answer starts: inside the channel the prompt left open,
        after an optional thought channel when thinking is on, else at once."""
        if spec is None:
            return None
        if self.starts_in_reasoning(prompt_ids):
            thinking = IN_THOUGHT
        elif (chat_template_kwargs or {}).get("enable_thinking"):
            thinking = MAY_THINK
        else:
            thinking = NO_THINKING
        return dataclasses.replace(spec, thinking=thinking)


@dataclass
class ToolCall:
    """A whole call, as the offline API returns it."""

    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass
class ToolCallDelta:
    """A piece of one call: the first carries its id and name, the others argument text."""

    index: int  # within the choice: 0, 1, ...
    arguments: str = ""  # a piece of the arguments' JSON text
    id: str | None = None
    name: str | None = None


@dataclass
class ChatDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def whole_calls(self) -> list[ToolCall]:
        """The calls of a delta that holds every piece of them (one entry per call)."""
        return [ToolCall(call.id, call.name, call.arguments) for call in self.tool_calls]

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        for call in other.tool_calls:  # pieces of the same call are joined
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and call.id is None:
                last.arguments += call.arguments
            else:
                self.tool_calls.append(dataclasses.replace(call))
        return self


class ChatOutputParser:
    """One choice's text, fed delta by delta; `feed` and `finish` return what became final.

    States: "content", "reasoning", "head" (after `<|tool_call>`, before the arguments' bracket)
    and "arguments". A bare `call:NAME{` (no `<|tool_call>`) opens a call in content when NAME is
    one of the request's tools and the opener starts the text or follows whitespace."""

    def __init__(
        self,
        markers: ChatMarkers,
        tool_schemas: dict[str, dict],
        in_reasoning: bool,
        calls: bool = True,
    ):
        # calls=False (tool_choice "none"): call markers are dropped like any other special
        # token, and what the call wrote stays content.
        self.calls = calls
        tool_schemas = tool_schemas if calls else {}
        self.tool_schemas = tool_schemas
        self._markers = markers
        self.state = "reasoning" if in_reasoning else "content"
        self._unread = ""  # the end of the text that may be the start of a special token
        self._label = in_reasoning  # the next reasoning text may start with the label
        self._held = ""  # a partial label; in content also trailing whitespace or a partial opener
        self._content_started = False  # a bare label can only come first
        self._after_break = False  # content resumes after a channel or a call: no leading space
        self._boundary = True  # content: the character before the held text is a space or none
        self._head = ""  # the open call's head
        self._arguments: ArgumentsStream | None = None
        self.num_calls = 0
        self._openers = tuple(f"call:{name}{bracket}" for name in tool_schemas for bracket in "{(")
        names = "|".join(map(re.escape, sorted(tool_schemas, key=len, reverse=True)))
        self._bare_opener = re.compile(rf"(?<!\S)call:({names})[{{(]") if names else None

    def parse(self, text: str) -> ChatDelta:
        """A whole choice at once (the same result as fed in any pieces)."""
        delta = self.feed(text)
        delta += self.finish()
        return delta

    def feed(self, text: str) -> ChatDelta:
        self._unread += text
        return self._read(final=False)

    def finish(self) -> ChatDelta:
        """The end of the choice: held text is resolved, trailing whitespace dropped, and an
        unclosed call's arguments completed (nothing the model wrote is lost)."""
        delta = self._read(final=True)
        if self.state == "head":
            delta += self._not_a_call()
        if self.state == "arguments":
            delta += self._close_call()
        if self.state == "content" and self._held.strip():
            delta.content += self._held.rstrip()
        self._held, self.state = "", "content"
        return delta

    def _read(self, final: bool) -> ChatDelta:
        delta = ChatDelta()
        text, self._unread, start = self._unread, "", 0
        for match in self._markers.splitter.finditer(text):
            delta += self._text(text[start : match.start()])
            delta += self._marker(match.group())
            start = match.end()
        text = text[start:]
        if not final:
            keep = len(text) - self._markers.partial_length(text)
            text, self._unread = text[:keep], text[keep:]
        delta += self._text(text)
        return delta

    # ---- special tokens ----

    def _marker(self, marker: str) -> ChatDelta:
        delta = ChatDelta()
        if self.state in ("head", "arguments"):
            if marker == QUOTE and self.state == "arguments":
                return self._arguments_text(QUOTE)
            if marker == QUOTE:
                return self._head_text(QUOTE)
            if marker not in (CALL_OPEN, CALL_CLOSE):
                return delta  # any other special token is not text
            delta += self._not_a_call() if self.state == "head" else self._close_call()
            if marker == CALL_CLOSE:
                return delta
        if self.state == "content" and self._held.strip():  # a label or opener cut short: text
            delta.content, self._held = self._held, ""
            self._content_started, self._boundary = True, False
        if marker == CALL_OPEN and self.calls:  # also from reasoning, which it ends
            self._held, self._head, self.state = "", "", "head"
        elif marker == CHANNEL_OPEN and self.state == "content":
            self.state, self._label = "reasoning", True
        elif marker == CHANNEL_CLOSE and self.state == "reasoning":
            self._held, self.state, self._after_break, self._boundary = "", "content", True, True
        return delta  # any other special token (or a stray marker) is not text

    # ---- text ----

    def _text(self, text: str) -> ChatDelta:
        if not text:
            return ChatDelta()
        if self.state == "reasoning":
            return self._reasoning_text(text)
        if self.state == "head":
            return self._head_text(text)
        if self.state == "arguments":
            return self._arguments_text(text)
        return self._content_text(text)

    def _reasoning_text(self, text: str) -> ChatDelta:
        text, self._held = self._held + text, ""
        if self._label:
            if LABEL.startswith(text):  # maybe the label, split over deltas
                self._held = text
                return ChatDelta()
            self._label = False
            text = text.removeprefix(LABEL)
        return ChatDelta(reasoning=text)

    def _content_text(self, text: str) -> ChatDelta:
        text, self._held = self._held + text, ""
        if self._after_break:
            text = text.lstrip()
            self._after_break = not text
        if not self._content_started:  # a bare label the model may write with thinking off
            if LABEL.startswith(text):
                self._held = text
                return ChatDelta()
            text = text.removeprefix(LABEL)
        openers = self._bare_opener.finditer(text) if self._bare_opener else ()
        opener = next((o for o in openers if o.start() > 0 or self._boundary), None)
        if opener is not None:
            delta = ChatDelta(content=text[: opener.start()].rstrip())
            self._content_started = self._content_started or bool(delta.content)
            self._held, self._head, self.state = "", text[opener.start() :], "head"
            delta += self._head_text("")
            return delta
        final = text[: self._possible_opener(text)].rstrip()
        self._held = text[len(final) :]  # whitespace before a call is not content
        if final:
            self._content_started, self._boundary = True, False
        return ChatDelta(content=final)

    def _possible_opener(self, text: str) -> int:
        """Where the end of `text` may be the start of a bare opener (else its length)."""
        longest = max(map(len, self._openers), default=0)
        for start in range(max(0, len(text) - longest), len(text)):
            at_boundary = text[start - 1].isspace() if start else self._boundary
            rest = text[start:]
            if at_boundary and any(opener.startswith(rest) for opener in self._openers):
                return start
        return len(text)

    def _head_text(self, text: str) -> ChatDelta:
        self._head += text
        head = CALL_HEAD.match(self._head)
        if head is None:
            if HEAD_CHARS.fullmatch(self._head):
                return ChatDelta()  # not complete yet
            return self._not_a_call()
        name = head.group(1)
        self._arguments = ArgumentsStream(self.tool_schemas.get(name))
        arguments, self._head = self._head[head.end() - 1 :], ""
        call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        delta = ChatDelta(tool_calls=[ToolCallDelta(self.num_calls, id=call_id, name=name)])
        self.num_calls += 1
        self.state = "arguments"
        delta += self._arguments_text(arguments)
        return delta

    def _not_a_call(self) -> ChatDelta:
        """The head after `<|tool_call>` is no call's: it is content."""
        text, self._head, self.state = self._head, "", "content"
        return self._replay(text) if text.strip() else ChatDelta()

    def _arguments_text(self, text: str) -> ChatDelta:
        delta = self._piece(self._arguments.feed(text))
        if self._arguments.done or self._arguments.error is not None:
            rest = self._arguments.rest
            delta += self._close_call()
            delta += self._replay(rest)
        return delta

    def _replay(self, text: str) -> ChatDelta:
        """Text a call did not take, read again as content (its only special token is `<|"|>`)."""
        delta = ChatDelta()
        for i, part in enumerate(text.split(QUOTE)):
            delta += self._marker(QUOTE) if i else ChatDelta()
            delta += self._text(part)
        return delta

    def _close_call(self) -> ChatDelta:
        closing = self._arguments.close()
        self._arguments, self.state = None, "content"
        self._after_break, self._boundary, self._held = True, True, ""
        return self._piece(closing)

    def _piece(self, arguments: str) -> ChatDelta:
        """A piece of the open call's arguments (none when empty)."""
        calls = [ToolCallDelta(self.num_calls - 1, arguments)] if arguments else []
        return ChatDelta(tool_calls=calls)
