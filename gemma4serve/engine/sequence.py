"""One generated sequence (a choice of a request) and the work a step does on it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gemma4serve.engine.outputs import TokenLogprob
from gemma4serve.engine.sampler import TokenRules
from gemma4serve.kv.manager import SeqPages
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.structured.grammar import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # choice index within its request
    token_ids: list[int]  # prompt + generated
    num_prompt: int
    params: SamplingParams
    seed: int
    arrival: int  # admission order, for picking preemption victims
    max_len: int  # prompt + max_tokens, capped by the context length
    status: Status = Status.WAITING
    num_computed: int = 0  # positions < num_computed have valid KV
    drafts: list[int] = field(default_factory=list)  # proposals for the token after the last one
    pages: SeqPages = field(default_factory=SeqPages)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    grammar: GrammarState | None = None  # structured output: the matcher of committed tokens
    num_cached_tokens: int | None = (
        None  # prompt tokens served by the prefix cache (first admission)
    )
    token_rules: TokenRules | None = None  # logit_bias, allowed_token_ids, bad_words, min_tokens
    # The request's prompt logprobs so far, on its first choice only (None: not wanted); entry i
    # scores prompt token i + 1.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]


@dataclass
class ScheduledChunk:
    """Tokens token_ids[start:start+length], then `drafts` if the chunk ends the sequence."""

    seq: Sequence
    start: int
    length: int
    drafts: list[int]

    @property
    def samples(self) -> bool:  # the chunk ends at the last token: its last rows produce new tokens
        return self.start + self.length == self.seq.num_tokens

    @property
    def num_query(self) -> int:
        return self.length + len(self.drafts)


@dataclass
class StepResult:
    """What one sampling chunk produced: accepted drafts + one bonus/correction token, and the next
    drafts."""

    tokens: list[int]
    next_drafts: list[int]
    num_drafted: int  # the drafts this step verified
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked for logprobs
