"""Plain dataclasses that cross the engine boundary (engine thread -> API / server)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from gemma4serve.chat.output import ToolCall


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs only)


@dataclass
class CompletionOutput:
    index: int  # choice index (0..n-1)
    text: str = ""  # everything produced so far (stop string excluded)
    token_ids: list[int] = field(default_factory=list)  # everything produced so far
    new_text: str = ""  # the part of `text` this output adds
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # LLM.chat only: `text` is the answer; the thought text and the calls the model wrote.
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() stamps
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # With prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:  # the first choice's, for the common n=1 case
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text


# vLLM's buckets for the tokens of one engine step.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    """A snapshot the server turns into Prometheus metrics at scrape time."""

    num_running: int = 0
    num_waiting: int = 0
    kv_pages_total: int = 0  # the arena's pages
    kv_pages_free: int = 0  # pages no sequence holds (idle prefix-cache pages included)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens served from it
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: dict = field(default_factory=dict)  # finish_reason -> count
    seq_steps: int = 0  # steps that produced tokens, counted per sequence
    spec_num_steps: int = 0  # of those, the verify steps that carried drafts
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list = field(
        default_factory=list
    )  # accepted count at draft position i
    draft_length: int = (
        0  # drafts the latest step proposed (0: no drafter, or drafting off at this load)
    )
    # Steps launched, by their tokens (prompt chunks' tokens, decode and verify rows): one count
    # per ITERATION_TOKEN_BUCKETS bound (tokens <= bound, not cumulative), then one past the last.
    iteration_tokens_counts: list = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
    )
    iteration_tokens_sum: int = 0

    def record_step(self, tokens: int) -> None:
        self.iteration_tokens_counts[bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self.iteration_tokens_sum += tokens

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verify step, bonus included (1 + accepted / steps)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_num_steps if self.spec_num_steps else 0.0
