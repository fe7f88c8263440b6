"""Response formats, one per endpoint and of one shape, so one generation loop serves both:
RequestOutputs in, OpenAI stream chunks or one final body out."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gemma4serve.chat.messages import tool_schemas
from gemma4serve.chat.output import ChatDelta, ChatMarkers, ChatOutputParser, ToolCallDelta
from gemma4serve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from gemma4serve.server.protocol import (
    ResponseHeader,
    TokenIdStrings,
    TokenStrings,
    chat_choice,
    chat_delta_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_body,
    usage_body,
)


@dataclass
class Prompt:
    """One prompt of a request, as the engine gets it."""

    token_ids: list[int]
    echo_text: str = ""  # what `echo` puts before the completion ("" without echo)


class ResponseFormat:
    """Turns RequestOutputs into stream chunks or one final body. Tracks per-choice state (finish
    reported, text offsets) across the outputs of one request."""

    def __init__(
        self,
        header: ResponseHeader,
        request,
        strings: TokenStrings | TokenIdStrings,
        prompts: list[Prompt],
        markers: ChatMarkers | None = None,
    ):
        self.header = header
        self.markers = markers
        self.request = request
        self.strings = strings
        # Batched prompts (completions): choice i belongs to prompt i // n, as OpenAI indexes them.
        self.prompts = prompts
        self.prompt_len = sum(len(prompt.token_ids) for prompt in prompts)
        self._finish_sent: set[int] = set()
        self.completion_tokens = 0  # totals of the latest output, summed over choices
        self.cached_tokens = 0  # prompt tokens the prefix cache served

    def usage(self) -> dict:
        return usage_body(self.prompt_len, self.completion_tokens, self.cached_tokens)

    def shown(self, output: RequestOutput) -> RequestOutput:
        """The engine's output as the response shows it (all of it, but for echo_only)."""
        return output

    def count(self, output: RequestOutput) -> None:
        """Keep the usage current: outputs carry each choice's totals."""
        self.completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        self.cached_tokens = output.num_cached_tokens

    @property
    def parses_output(self) -> bool:
        """Whether choices are split into reasoning, content and tool calls (chat only)."""
        return False

    def step(self, output: RequestOutput) -> list[dict]:
        self.count(output)
        chunks = []
        for c in output.outputs:
            choice = self.delta_choice(c, output)
            if choice is not None:
                chunks.append(self._chunk([choice]))
            if c.finish_reason is not None and c.index not in self._finish_sent:
                self._finish_sent.add(c.index)
                chunks.append(self._chunk([self.finish_choice(c)]))
        return chunks

    def closing(self) -> list[dict]:
        if self.request.include_usage:
            return [self._chunk([], self.usage(), final=True)]
        return []

    def _chunk(
        self, choices: list[dict], usage: dict | None = None, *, final: bool = False
    ) -> dict:
        if self.request.continuous_usage and not final:
            usage = self.usage()
        return self.envelope(choices, usage, with_usage=self.request.include_usage)

    def scored_prompt(self, output: RequestOutput, prompt: int = 0) -> list | None:
        """Prompt `prompt`'s logprobs in `output` (a batch's are one list, in prompt order)."""
        if output.prompt_logprobs is None:
            return None
        start = sum(len(p.token_ids) for p in self.prompts[:prompt])
        return output.prompt_logprobs[start : start + len(self.prompts[prompt].token_ids)]

    def prompt_logprobs(self, output: RequestOutput, prompt: int = 0) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` body of one prompt, when the request asked for them."""
        scored = self.scored_prompt(output, prompt)
        if self.request.prompt_logprobs is None or scored is None:
            return None
        return prompt_logprobs_body(scored, self.strings)

    # Per-endpoint parts
    def opening(self, output: RequestOutput) -> list[dict]:
        """The chunks before the first tokens (`output`: the engine's first)."""
        raise NotImplementedError

    def envelope(self, choices, usage, *, with_usage) -> dict:
        raise NotImplementedError

    def delta_choice(self, c: CompletionOutput, output: RequestOutput) -> dict | None:
        """The choice's delta in this output, or None when it has none."""
        raise NotImplementedError

    def finish_choice(self, c: CompletionOutput) -> dict:
        raise NotImplementedError

    def body(self, output: RequestOutput, logprobs: dict[int, list[TokenLogprob]]) -> dict:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parsers: dict[int, ChatOutputParser] = {}  # per choice, while streaming

    @property
    def parses_output(self) -> bool:
        return self.markers is not None and self.request.skip_special_tokens

    @property
    def hides_tokens(self) -> bool:
        """With the reasoning dropped, a choice's logprobs and token ids are too (they would
        show it), as vLLM drops them."""
        return self.parses_output and not self.request.include_reasoning

    @property
    def shows_token_ids(self) -> bool:
        return self.request.return_token_ids and not self.hides_tokens

    def opening(self, output: RequestOutput) -> list[dict]:
        # OpenAI's first chunk of each choice carries the role and an empty content.
        chunks = [
            self._chunk([chat_delta_choice(i, {"role": "assistant", "content": ""})])
            for i in range(len(output.outputs))
        ]
        prompt_logprobs = self.prompt_logprobs(output)
        if prompt_logprobs is not None:  # vLLM: at the top of the first chunk
            chunks[0]["prompt_logprobs"] = prompt_logprobs
        if self.request.return_token_ids:  # vLLM: at the top of each choice's first chunk
            for chunk in chunks:
                chunk["prompt_token_ids"] = output.prompt_token_ids
        return chunks

    def envelope(self, choices, usage, *, with_usage) -> dict:
        return self.header.chat_chunk(choices, usage, with_usage=with_usage)

    def delta_choice(self, c: CompletionOutput, output: RequestOutput) -> dict | None:
        new_logprobs = None if self.hides_tokens else c.new_logprobs
        logprobs = chat_logprobs(new_logprobs, self.strings) if new_logprobs is not None else None
        # With return_token_ids every token is shown, so a chunk goes out even without text.
        ids = self.shows_token_ids and c.new_token_ids
        if not self.parses_output:
            if not (c.new_text or new_logprobs or ids):
                return None
            fields = {"content": c.new_text}
        else:
            if c.index not in self._parsers:
                self._parsers[c.index] = self._parser(output.prompt_token_ids)
            parser = self._parsers[c.index]
            delta = parser.feed(c.new_text)
            if c.finish_reason is not None:
                delta += parser.finish()
            fields = self._fields(delta, streamed=True)
            if not (fields or new_logprobs or ids):
                return None
        choice = chat_delta_choice(c.index, fields, logprobs)
        if self.shows_token_ids:
            choice["token_ids"] = c.new_token_ids
        return choice

    def finish_choice(self, c: CompletionOutput) -> dict:
        parser = self._parsers.get(c.index)
        reason = _finish_reason(c.finish_reason, parser)
        return chat_delta_choice(c.index, {}, None, reason, c.stop_reason)

    def body(self, output, logprobs) -> dict:
        want = self.request.logprobs and not self.hides_tokens
        choices = []
        for c in output.outputs:
            message, parser = {"content": c.text}, None
            if self.parses_output:
                parser = self._parser(output.prompt_token_ids)
                delta = parser.parse(c.text)
                message = self._fields(delta, streamed=False)
                message.setdefault("content", None if delta.tool_calls else "")
            choice = chat_choice(
                c.index,
                message,
                chat_logprobs(logprobs.get(c.index, []), self.strings) if want else None,
                _finish_reason(c.finish_reason, parser),
                c.stop_reason,
            )
            if self.shows_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = self.header.chat_completion(choices, self.usage())
        prompt_logprobs = self.prompt_logprobs(output)
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if self.request.return_token_ids:
            body["prompt_token_ids"] = output.prompt_token_ids
        return body

    def _parser(self, prompt_ids: list[int]) -> ChatOutputParser:
        return ChatOutputParser(
            self.markers,
            tool_schemas(self.request.tools),
            self.markers.starts_in_reasoning(prompt_ids),
            calls=self.request.parses_tool_calls,
        )

    def _fields(self, delta: ChatDelta, *, streamed: bool) -> dict:
        """OpenAI's message (or delta) fields for what the parser returned."""
        fields = {}
        if delta.content:
            fields["content"] = delta.content
        if delta.reasoning and self.request.include_reasoning:
            # vLLM's two names for it: reasoning_content (before 0.18) and reasoning
            fields["reasoning_content"] = fields["reasoning"] = delta.reasoning
        calls = delta.tool_calls
        if self.request.parallel_tool_calls is False:  # vLLM keeps the first call only
            calls = [call for call in calls if call.index == 0]
        if calls:
            fields["tool_calls"] = [_tool_call(call, streamed) for call in calls]
        return fields


def _tool_call(call: ToolCallDelta, streamed: bool) -> dict:
    """A call's fields: streamed, its first delta carries the id and name, the others only
    `index` and a piece of the arguments; whole (joined), the complete call."""
    fields: dict = {"index": call.index} if streamed else {}
    function = {}
    if call.id is not None:
        fields.update(id=call.id, type="function")
        function["name"] = call.name
    if call.arguments or not streamed:
        function["arguments"] = call.arguments
    return {**fields, "function": function}


def _finish_reason(reason: str | None, parser: ChatOutputParser | None) -> str | None:
    """ "tool_calls" for a choice that stopped after writing calls."""
    if reason == "stop" and parser is not None and parser.num_calls:
        return "tool_calls"
    return reason


class CompletionFormat(ResponseFormat):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}
        self._opened: set[int] = set()  # choices whose first chunk went out

    def _prompt(self, index: int) -> Prompt:
        return self.prompts[index // self.request.n]

    def opening(self, output: RequestOutput) -> list[dict]:
        chunks = []
        for i in range(len(output.outputs)):
            echo = self._prompt(i).echo_text
            prompt_logprobs = self.prompt_logprobs(output, i // self.request.n)
            if not echo and prompt_logprobs is None:
                continue
            choice = completion_choice(i, echo, self._echo_logprobs(i, output), None)
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            chunks.append(self._chunk([self._first_of_choice(choice)]))
        return chunks

    def _first_of_choice(self, choice: dict) -> dict:
        """vLLM's return_token_ids: each choice's first chunk carries its prompt's ids."""
        index = choice["index"]
        if self.request.return_token_ids and index not in self._opened:
            choice["prompt_token_ids"] = self._prompt(index).token_ids
        self._opened.add(index)
        return choice

    def _echo_logprobs(self, index: int, output: RequestOutput) -> dict | None:
        """The echoed prompt's logprobs (echo with logprobs), else None."""
        if not (self._prompt(index).echo_text and self.request.logprobs is not None):
            return None
        return echo_logprobs(
            self._prompt(index).token_ids,
            self.scored_prompt(output, index // self.request.n) or [],
            self.strings,
            self.request.skip_special_tokens,
        )

    def envelope(self, choices, usage, *, with_usage) -> dict:
        return self.header.completion_chunk(choices, usage, with_usage=with_usage)

    def shown(self, output: RequestOutput) -> RequestOutput:
        """echo_only: the one token the engine ran is not shown (nor counted), and a choice it
        ended ends at its length (an abort stays one)."""
        if not self.request.echo_only:
            return output
        choices = []
        for c in output.outputs:
            ended = "length" if c.finish_reason in ("length", "stop") else c.finish_reason
            choices.append(CompletionOutput(c.index, finish_reason=ended))
        return replace(output, outputs=choices)

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict:
        offset = self._offsets.get(index, len(self._prompt(index).echo_text))
        body, self._offsets[index] = completion_logprobs(
            logprobs, self.strings, offset, self.request.skip_special_tokens
        )
        return body

    def delta_choice(self, c: CompletionOutput, output: RequestOutput) -> dict | None:
        ids = self.request.return_token_ids and c.new_token_ids
        if not (c.new_text or c.new_logprobs or ids):
            return None
        logprobs = self._logprobs(c.index, c.new_logprobs) if c.new_logprobs is not None else None
        choice = completion_choice(c.index, c.new_text, logprobs, None)
        if self.request.return_token_ids:
            choice["token_ids"] = c.new_token_ids
        return self._first_of_choice(choice)

    def finish_choice(self, c: CompletionOutput) -> dict:
        return self._first_of_choice(
            completion_choice(c.index, "", None, c.finish_reason, c.stop_reason)
        )

    def body(self, output, logprobs) -> dict:
        want = self.request.logprobs is not None
        choices = []
        for c in output.outputs:
            prompt_logprobs = self.prompt_logprobs(output, c.index // self.request.n)
            choice_logprobs = None
            if want:
                choice_logprobs = self._logprobs(c.index, logprobs.get(c.index, []))
                echoed = self._echo_logprobs(c.index, output)
                if echoed is not None:
                    choice_logprobs = {k: echoed[k] + choice_logprobs[k] for k in echoed}
            choice = completion_choice(
                c.index,
                self._prompt(c.index).echo_text + c.text,
                choice_logprobs,
                c.finish_reason,
                c.stop_reason,
            )
            if prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs
            if self.request.return_token_ids:  # vLLM's extension: the ids without a tokenizer
                choice["prompt_token_ids"] = self._prompt(c.index).token_ids
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return self.header.completion(choices, self.usage())
