"""The engine's token outputs made whole: text, stop strings and the cumulative fields.

The engine finds the stops it can see in tokens (EOS, stop_token_ids, max_tokens) and reports only
each step's new tokens (and the prompt's logprobs once). The `OutputProcessor` decodes them, finds
stop strings in the text, and gives each output its prompt, prompt logprobs, cumulative token ids
and text. A choice a stop string ended is
handed back to the engine as a `StopChoice`, to be finished there; tokens the engine produced for
it meanwhile are dropped. The server runs one in its own process (the engine process then never
detokenizes); the in-process `LLMEngine` runs one on its own outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gemma4serve.detokenizer import IncrementalDetokenizer
from gemma4serve.engine.outputs import CompletionOutput, RequestOutput
from gemma4serve.sampling_params import SamplingParams


@dataclass
class StopChoice:
    """A choice a stop string ended: the engine finishes it with finish_reason "stop"."""

    request_id: str
    index: int
    stop: str


@dataclass
class _ChoiceState:
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_ChoiceState]
    prompt_logprobs: list | None = None  # the engine sends them once

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: token ids only, no text and no stop strings
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self._requests[request_id] = _RequestState(
            prompt_token_ids,
            params,
            [_ChoiceState(self._detokenizer(params)) for _ in range(params.n)],
        )

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings,  # one automaton (cached), shared by the choices
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, output: RequestOutput) -> tuple[RequestOutput | None, list[StopChoice]]:
        """Complete one engine output in place; None when the request is unknown or already ended
        here. Also returns the choices that stop strings ended in it."""
        request = self._requests.get(output.request_id)
        if request is None:
            return None, []
        stopped = []
        for choice in output.outputs:
            state = request.choices[choice.index]
            if state.finish_reason is None:
                if self._append(request.params, state, choice):
                    stopped.append(StopChoice(output.request_id, choice.index, choice.stop_reason))
            else:  # ended before (here by a stop string): what the engine made since is dropped
                choice.new_token_ids, choice.new_text = [], ""
                choice.new_logprobs = [] if choice.new_logprobs is not None else None
                choice.finish_reason, choice.stop_reason = state.finish_reason, state.stop_reason
            choice.token_ids = state.token_ids  # not copied: it grows until the choice ends
            choice.text = state.detokenizer.text if state.detokenizer is not None else ""
        output.prompt_token_ids = request.prompt_token_ids
        if output.prompt_logprobs is not None:
            request.prompt_logprobs = output.prompt_logprobs
        output.prompt_logprobs = request.prompt_logprobs
        output.finished = request.finished
        if output.finished:
            del self._requests[output.request_id]
            if output.metrics is not None and output.metrics.finished_time is None:
                output.metrics.finished_time = time.monotonic()  # the same clock in every process
        return output, stopped

    def _append(
        self, params: SamplingParams, state: _ChoiceState, choice: CompletionOutput
    ) -> bool:
        """Take the choice's new tokens up to the first stop string; True if one ended it."""
        detokenizer, new_ids = state.detokenizer, choice.new_token_ids
        # A choice the engine ended on a token (EOS or a stop token id) shows that token's text
        # only with include_stop_str_in_output, as vLLM does.
        ends_on_token = choice.finish_reason == "stop" and isinstance(choice.stop_reason, int)
        text, stopped = [], False
        for position, token in enumerate(new_ids):
            state.token_ids.append(token)
            if detokenizer is None:
                continue
            if ends_on_token and position == len(new_ids) - 1:
                if params.include_stop_str_in_output:
                    text.append(detokenizer.push([token])[0])
                break
            # vLLM: stop strings count once the output is longer than min_tokens
            piece, stop = detokenizer.push([token], len(state.token_ids) > params.min_tokens)
            text.append(piece)
            if stop is not None:
                del new_ids[position + 1 :]
                if choice.new_logprobs is not None:
                    del choice.new_logprobs[position + 1 :]
                choice.finish_reason, choice.stop_reason = "stop", stop
                stopped = True
                break
        state.finish_reason, state.stop_reason = choice.finish_reason, choice.stop_reason
        if detokenizer is not None and state.finish_reason is not None:
            text.append(detokenizer.flush())
        choice.new_text = "".join(text)
        return stopped
