"""The offline API: `LLM(model=..., draft=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools

from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.engine import LLMEngine
from gemma4serve.engine.outputs import RequestOutput
from gemma4serve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, draft: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineArgs(model=model, draft=draft, **kwargs))
        self._ids = itertools.count()

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
