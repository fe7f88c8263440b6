"""Per-request generation settings (the vLLM-shaped public API)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from gemma4serve.stop_strings import StopStrings
from gemma4serve.structured.spec import StructuredOutputsParams

# The sampler packs top_k into int32: a larger one would fail the whole batch's step.
MAX_TOP_K = 2**31 - 1
# The sampler holds the float settings in float32: a value that would become 0, subnormal or inf
# there (top_p 1e-50, repetition_penalty 5e-324) is refused rather than silently changed.
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest positive normal float32
FLOAT32_MAX = 3.4028234663852886e38
# A request's seed and token ids cross to the engine process as 64-bit integers; vLLM bounds
# the seed the same way.
INT64 = range(-(2**63), 2**63)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None = up to the context length
    temperature: float = 1.0  # 0 = greedy (lowest token id on ties)
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = the sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's token rules, applied to the logits before sampling:
    min_tokens: int = 0  # no EOS or stop token before this many output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    bad_words: list[str] | None = None  # never write these words (as token sequences)
    structured_outputs: StructuredOutputsParams | None = None  # None = unconstrained
    # vLLM's per-request prefix-cache salt (a request field there): pages are shared only among
    # requests of the same salt, so tenants cannot probe each other's prompts through cache hits
    cache_salt: str | None = field(default=None, repr=False)  # kept out of logged settings

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a user-facing message on values no sampler can honour."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if value != 0.0 and not (FLOAT32_TINY <= abs(value) <= FLOAT32_MAX):
                raise ValueError(
                    f"{name} must be 0 or of magnitude in [{FLOAT32_TINY:.8g}, {FLOAT32_MAX:.8g}]"
                    f" (the sampler's float32), got {value}"
                )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not (0 <= self.top_k <= MAX_TOP_K):
            raise ValueError(
                f"top_k must be -1 or 0 (off), or in [1, {MAX_TOP_K}], got {self.top_k}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.seed == -1:  # vLLM's spelling of "no seed" (UIs send it for random)
            self.seed = None
        if self.seed is not None and self.seed not in INT64:
            raise ValueError(f"seed must be in [-2**63, 2**63), got {self.seed}")
        token_ids = {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
        }
        for name, ids in token_ids.items():
            outside = next((t for t in ids if t not in INT64), None)
            if outside is not None:
                raise ValueError(f"{name} holds {outside}, which is no token id")
        if self.bad_words is not None and any(not word.strip() for word in self.bad_words):
            raise ValueError("bad_words must not hold empty words")

    @property
    def has_token_rules(self) -> bool:
        """Whether the sampler must edit this request's logits (min_tokens, logit_bias,
        allowed_token_ids, bad_words)."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids or self.bad_words)

    @functools.cached_property
    def stop_strings(self) -> StopStrings:
        """The automaton over `stop`, built on first use and shared by the request's choices (the
        server builds it in its thread pool, so its event loop's output processor only steps it)."""
        return StopStrings(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
