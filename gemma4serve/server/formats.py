"""Response formats, one per endpoint and of one shape, so one generation loop serves both:
RequestOutputs in, OpenAI stream chunks or one final body out."""

from __future__ import annotations

from gemma4serve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from gemma4serve.server.protocol import (
    ResponseHeader,
    TokenStrings,
    chat_choice,
    chat_delta_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    usage_body,
)


class ResponseFormat:
    """Turns RequestOutputs into stream chunks or one final body. Tracks per-choice state (finish
    reported, text offsets) across the outputs of one request."""

    def __init__(
        self,
        header: ResponseHeader,
        request,
        strings: TokenStrings,
        prompt_len: int,
        echo_text: str = "",
    ):
        self.header = header
        self.request = request
        self.strings = strings
        self.prompt_len = prompt_len
        self.echo_text = echo_text  # the prompt text `echo` puts first ("" without echo)
        self._finish_sent: set[int] = set()
        self.completion_tokens = 0  # totals of the latest output, summed over choices
        self.cached_tokens = 0  # prompt tokens the prefix cache served

    def usage(self) -> dict:
        return usage_body(self.prompt_len, self.completion_tokens, self.cached_tokens)

    def count(self, output: RequestOutput) -> None:
        """Keep the usage current: outputs carry each choice's totals."""
        self.completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        self.cached_tokens = output.num_cached_tokens

    def step(self, output: RequestOutput) -> list[dict]:
        self.count(output)
        chunks = []
        for c in output.outputs:
            if self.has_delta(c):
                chunks.append(self._chunk([self.delta_choice(c)]))
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

    def has_delta(self, c: CompletionOutput) -> bool:
        return bool(c.new_text or c.new_logprobs)

    # Per-endpoint parts
    def opening(self, n: int) -> list[dict]:
        raise NotImplementedError

    def envelope(self, choices, usage, *, with_usage) -> dict:
        raise NotImplementedError

    def delta_choice(self, c: CompletionOutput) -> dict:
        raise NotImplementedError

    def finish_choice(self, c: CompletionOutput) -> dict:
        raise NotImplementedError

    def body(self, output: RequestOutput, logprobs: dict[int, list[TokenLogprob]]) -> dict:
        raise NotImplementedError


class ChatFormat(ResponseFormat):
    def opening(self, n: int) -> list[dict]:
        # OpenAI's first chunk of each choice carries the role and an empty content.
        return [
            self._chunk([chat_delta_choice(i, {"role": "assistant", "content": ""})])
            for i in range(n)
        ]

    def envelope(self, choices, usage, *, with_usage) -> dict:
        return self.header.chat_chunk(choices, usage, with_usage=with_usage)

    def delta_choice(self, c: CompletionOutput) -> dict:
        logprobs = (
            chat_logprobs(c.new_logprobs, self.strings) if c.new_logprobs is not None else None
        )
        return chat_delta_choice(c.index, {"content": c.new_text}, logprobs)

    def finish_choice(self, c: CompletionOutput) -> dict:
        return chat_delta_choice(c.index, {}, None, c.finish_reason, c.stop_reason)

    def body(self, output, logprobs) -> dict:
        want = self.request.logprobs
        choices = [
            chat_choice(
                c.index,
                c.text,
                chat_logprobs(logprobs.get(c.index, []), self.strings) if want else None,
                c.finish_reason,
                c.stop_reason,
            )
            for c in output.outputs
        ]
        return self.header.chat_completion(choices, self.usage())


class CompletionFormat(ResponseFormat):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, int] = {}

    def opening(self, n: int) -> list[dict]:
        if not self.echo_text:
            return []
        return [self._chunk([completion_choice(i, self.echo_text, None, None)]) for i in range(n)]

    def envelope(self, choices, usage, *, with_usage) -> dict:
        return self.header.completion_chunk(choices, usage, with_usage=with_usage)

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict:
        offset = self._offsets.get(index, len(self.echo_text))
        body = completion_logprobs(logprobs, self.strings, offset)
        self._offsets[index] = offset + sum(len(t) for t in body["tokens"])
        return body

    def has_delta(self, c: CompletionOutput) -> bool:
        return super().has_delta(c) or bool(self.request.return_token_ids and c.new_token_ids)

    def delta_choice(self, c: CompletionOutput) -> dict:
        logprobs = self._logprobs(c.index, c.new_logprobs) if c.new_logprobs is not None else None
        choice = completion_choice(c.index, c.new_text, logprobs, None)
        if self.request.return_token_ids:
            choice["token_ids"] = c.new_token_ids
        return choice

    def finish_choice(self, c: CompletionOutput) -> dict:
        return completion_choice(c.index, "", None, c.finish_reason, c.stop_reason)

    def body(self, output, logprobs) -> dict:
        want = self.request.logprobs is not None
        choices = []
        for c in output.outputs:
            choice = completion_choice(
                c.index,
                self.echo_text + c.text,
                self._logprobs(c.index, logprobs.get(c.index, [])) if want else None,
                c.finish_reason,
                c.stop_reason,
            )
            if self.request.return_token_ids:  # vLLM's extension: the ids without a tokenizer
                choice["prompt_token_ids"] = output.prompt_token_ids
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return self.header.completion(choices, self.usage())
