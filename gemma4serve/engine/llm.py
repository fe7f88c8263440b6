"""The offline API: `LLM(model=..., draft=...).generate(prompts, SamplingParams(...))`, and
`chat(messages, tools=...)` through the checkpoint's chat template."""

from __future__ import annotations

import dataclasses
import itertools

from gemma4serve.chat.messages import template_message, tool_calls_spec, tool_schemas
from gemma4serve.chat.output import ChatMarkers, ChatOutputParser
from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.engine import LLMEngine
from gemma4serve.engine.outputs import RequestOutput
from gemma4serve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, draft: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineArgs(model=model, draft=draft, **kwargs))
        self._ids = itertools.count()
        self._markers = ChatMarkers.from_tokenizer(self.engine.tokenizer)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for prompt, p in zip(prompts, params):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """One conversation (or a list of them) rendered by the checkpoint's chat template, as
        the server renders it. Each choice's `text` is the answer, `reasoning` the thought text
        and `tool_calls` the calls (arguments as JSON typed by the tool's schema), split out as
        the server splits them, unless the params ask for raw text (skip_special_tokens=False).
        `tool_choice` and `parallel_tool_calls` as the server takes them: "required" or a named
        function forces calls through a grammar, "none" parses none."""
        forced = tool_calls_spec(tools, tool_choice, parallel_tool_calls)  # ValueError if bad
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    [template_message(m) for m in conversation],
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    chat_template=chat_template,  # None: the checkpoint's
                    **(chat_template_kwargs or {}),
                )
            )
            for conversation in conversations
        ]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        parse = [self._markers is not None and p.skip_special_tokens for p in params]
        params = [
            dataclasses.replace(p, skip_special_tokens=False) if wanted else p
            for p, wanted in zip(params, parse)
        ]
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            structured = forced or p.structured_outputs
            if self._markers is not None:  # the grammar starts after the thinking, as served
                structured = self._markers.after_thinking(structured, prompt, chat_template_kwargs)
            params[i] = dataclasses.replace(p, structured_outputs=structured)
        outputs = self.generate(prompts, params)
        for output, wanted in zip(outputs, parse):
            if wanted:
                self._split(output, tool_schemas(tools), calls=tool_choice != "none")
            if parallel_tool_calls is False:  # as the server: the first call only
                for choice in output.outputs:
                    choice.tool_calls = choice.tool_calls and choice.tool_calls[:1]
        return outputs

    def _split(self, output: RequestOutput, schemas: dict, calls: bool) -> None:
        in_reasoning = self._markers.starts_in_reasoning(output.prompt_token_ids)
        for choice in output.outputs:
            parser = ChatOutputParser(self._markers, schemas, in_reasoning, calls=calls)
            parsed = parser.parse(choice.text)
            choice.text, choice.reasoning = parsed.content, parsed.reasoning
            choice.tool_calls = parsed.whole_calls()
