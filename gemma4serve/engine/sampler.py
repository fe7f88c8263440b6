"""Device-side sampling and speculative verification (docs/gemma4.md §12.4 / §12.5).

Everything in the step functions (`process_logits`, `choose`, `accept`) is batched tensor arithmetic
with static shapes: no host synchronisation and no per-row Python, so the engine can capture them in
CUDA graphs. Host-side decisions (which code paths a batch needs) are plain Python values fixed when
the batch is built.

Verification and losslessness. Drafts are the drafter's argmax, a deterministic proposal
(q = one-hot), so the lossless rule is: accept draft d with probability p(d); on rejection emit a
sample from p with d removed; if all drafts are accepted emit a bonus sample from the last row. We
realise it with a Gumbel-max coupling: every row draws s_j = argmax(p_j / Exp(1)) -- an exact
sample from p_j -- and a draft is accepted iff it equals that sample. P(s = d) = p(d), and given
s != d, s is distributed as p without d, renormalised: exactly the rule above, so greedy and
sampled verification share one code path ("longest prefix of drafts equal to the row's choice,
then one more token"). Because the choice at a position depends only on (seed, position, target
distribution), a seeded request emits the same tokens with or without speculation, whatever the
drafts were and whatever else is in the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gemma4serve.engine.random_streams import Stream, row_keys, uniform_from_keys
from gemma4serve.sampling_params import SamplingParams
from gemma4serve.structured.bitmask import apply_bitmask

# On CUDA the noise + race + argmax runs as one torch.compile'd kernel: eagerly, each of the hash's
# ~30 integer ops makes its own pass over [R, V]. The engine must call accept() once before
# capturing it in a CUDA graph, so that compilation happens outside the capture.
COMPILE_RACE = True


# --------------------------------------------------------------------------------------------------
# Batch of per-sequence sampling settings
# --------------------------------------------------------------------------------------------------


@dataclass
class TokenRules:
    """A request's vLLM token rules (logit_bias, allowed_token_ids, bad_words, min_tokens),
    resolved to token ids once when the request is added. Host side."""

    bias: dict[int, float]  # added to the logits: logit_bias, and -inf for 1-token bad words
    allowed: list[int] | None  # only these may be chosen (None: all)
    bad_sequences: list[list[int]]  # bad words of 2+ tokens: the last is banned after the rest
    end_ids: list[int]  # EOS and stop tokens: banned while position < min_tokens_position
    min_tokens_position: int  # the prompt's length + min_tokens


def needs_host_between_steps(params: SamplingParams, rules: TokenRules | None) -> bool:
    """Whether a sequence's next step needs the host's view of the step before: a grammar's mask,
    a penalty's token counts, a multi-token bad word's tail (SamplingBatch.reads_history and
    .constrained, for one request)."""
    return (
        params.structured_outputs is not None
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
        or (rules is not None and bool(rules.bad_sequences))
    )


HOST = "cpu"  # where build() makes its tensors: explicit, whatever torch's default device


@dataclass
class TokenRuleTensors:
    """TokenRules of a batch, one row per sequence, -1 padded (built on the host; the runner
    queues the copies to the device)."""

    bias_ids: torch.Tensor  # [B, M] int64
    bias_values: torch.Tensor  # [B, M] f32
    allowed_ids: torch.Tensor  # [B, A] int64
    restricted: torch.Tensor  # [B] bool: the row has an allowed set
    end_ids: torch.Tensor  # [B, E] int64
    min_tokens_position: torch.Tensor  # [B] int64
    # Bad words of 2+ tokens: prefixes right-aligned in L = the longest prefix, ANY_TOKEN before
    # a shorter one; W = the most words of a row.
    bad_prefixes: torch.Tensor  # [B, W, L] int64
    bad_last: torch.Tensor  # [B, W] int64
    output_tail: torch.Tensor  # [B, L] int64: the row's last L output tokens, -1 before them

    @property
    def reads_history(self) -> bool:
        return self.bad_last.shape[1] > 0

    @classmethod
    def build(
        cls, rules: list[TokenRules | None], output_tokens: list[list[int]]
    ) -> TokenRuleTensors:
        none = TokenRules({}, None, [], [], 0)
        rules = [rule or none for rule in rules]
        width = max((len(seq) - 1 for rule in rules for seq in rule.bad_sequences), default=0)
        prefixes = [
            [[ANY_TOKEN] * (width - len(seq) + 1) + seq[:-1] for seq in rule.bad_sequences]
            for rule in rules
        ]
        most_words = max((len(rows) for rows in prefixes), default=0)
        tails = [
            ([-1] * width + output)[len(output) :] if width else [] for output in output_tokens
        ]

        def f32(rows):
            return torch.tensor(rows, dtype=torch.float32, device=HOST)

        return cls(
            bias_ids=_pad([list(rule.bias) for rule in rules]),
            bias_values=f32(_padded([list(rule.bias.values()) for rule in rules], 0.0)),
            allowed_ids=_pad([rule.allowed or [] for rule in rules]),
            restricted=torch.tensor(
                [rule.allowed is not None for rule in rules], dtype=torch.bool, device=HOST
            ),
            end_ids=_pad([rule.end_ids for rule in rules]),
            min_tokens_position=torch.tensor(
                [rule.min_tokens_position for rule in rules], dtype=torch.int64, device=HOST
            ),
            bad_prefixes=torch.tensor(
                [rows + [[-1] * width] * (most_words - len(rows)) for rows in prefixes],
                dtype=torch.int64,
                device=HOST,
            ).view(len(rules), most_words, width),
            bad_last=_pad([[seq[-1] for seq in rule.bad_sequences] for rule in rules]),
            output_tail=torch.tensor(tails, dtype=torch.int64, device=HOST).view(len(rules), width),
        )


ANY_TOKEN = -2  # a bad-word prefix position that matches whatever token is there


@dataclass
class SamplingBatch:
    """One row per sequence in the step (B sequences); the runner's copy has its tensors on the
    device."""

    temperature: torch.Tensor  # [B] f32, 0 = greedy
    top_k: torch.Tensor  # [B] int32, 0 = off
    top_p: torch.Tensor  # [B] f32, 1 = off
    min_p: torch.Tensor  # [B] f32, 0 = off
    seed: torch.Tensor  # [B] int64
    presence_penalty: torch.Tensor  # [B] f32
    frequency_penalty: torch.Tensor  # [B] f32
    repetition_penalty: torch.Tensor  # [B] f32
    # [B, Mo] int64, -1 padded; [B, 0] when no row has a penalty.
    output_tokens: torch.Tensor
    # [B, Mp] int64, -1 padded; [B, 0] when no row has a repetition penalty.
    prompt_tokens: torch.Tensor
    # Host-side flags: they pick code paths, so they must not depend on device data.
    any_penalty: bool
    all_greedy: bool
    any_truncation: bool  # some sampled row uses top-k, top-p or min-p
    # How many of the largest logits top-k / top-p must sort: 0 = no sampled row uses them, -1 = the
    # whole vocabulary (a row uses top-p without top-k), else the largest top_k.
    sort_width: int
    num_logprobs: int  # the most top-logprobs any row asked for, -1 = no row wants logprobs
    rules: TokenRuleTensors | None = None  # None: no row has token rules (no cost)
    constrained: bool = False  # some row follows a grammar: its mask needs the logits

    @property
    def argmax_only(self) -> bool:
        """Every row takes the argmax of the raw logits and nothing else reads them: the tokens can
        come from the model's greedy head without the logits."""
        return (
            self.all_greedy
            and not self.any_penalty
            and self.rules is None
            and self.num_logprobs < 0
            and not self.constrained
        )

    @property
    def reads_history(self) -> bool:
        """Rows need the host's token history (penalties, multi-token bad words), so the next
        step cannot be built on the device alone."""
        return self.any_penalty or (self.rules is not None and self.rules.reads_history)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_tokens: list[list[int]],
        prompt_tokens: list[list[int]],
        rules: list[TokenRules | None] | None = None,
    ) -> SamplingBatch:
        """Pack per-request settings into host tensors; the runner queues their copies to the
        device (built there directly, each would wait for the step in flight)."""
        greedy = [request.temperature == 0.0 for request in params]
        # Greedy rows skip truncation; neutral values keep that true even if a caller ignores the
        # flags.
        top_k = [0 if is_greedy else request.top_k for request, is_greedy in zip(params, greedy)]
        top_p = [1.0 if is_greedy else request.top_p for request, is_greedy in zip(params, greedy)]
        min_p = [0.0 if is_greedy else request.min_p for request, is_greedy in zip(params, greedy)]
        any_freq_presence = any(
            request.presence_penalty != 0.0 or request.frequency_penalty != 0.0
            for request in params
        )
        any_repetition = any(request.repetition_penalty != 1.0 for request in params)
        any_penalty = any_freq_presence or any_repetition
        # Token histories can be long: ship them only when a penalty will read them.
        outputs = output_tokens if any_penalty else [[] for _ in params]
        prompts = prompt_tokens if any_repetition else [[] for _ in params]
        logprobs = [request.logprobs for request in params if request.logprobs is not None]
        truncating_top_k = [
            row_top_k
            for row_top_k, row_top_p in zip(top_k, top_p)
            if row_top_k > 0 or row_top_p < 1.0
        ]
        if not truncating_top_k:
            sort_width = 0
        elif all(row_top_k > 0 for row_top_k in truncating_top_k):
            sort_width = max(truncating_top_k)
        else:
            sort_width = -1

        def f32(values):
            return torch.tensor(values, dtype=torch.float32, device=HOST)

        return cls(
            temperature=f32([request.temperature for request in params]),
            top_k=torch.tensor(top_k, dtype=torch.int32, device=HOST),
            top_p=f32(top_p),
            min_p=f32(min_p),
            seed=torch.tensor([_to_int64(seed) for seed in seeds], dtype=torch.int64, device=HOST),
            presence_penalty=f32([request.presence_penalty for request in params]),
            frequency_penalty=f32([request.frequency_penalty for request in params]),
            repetition_penalty=f32([request.repetition_penalty for request in params]),
            output_tokens=_pad(outputs),
            prompt_tokens=_pad(prompts),
            any_penalty=any_penalty,
            all_greedy=all(greedy),
            any_truncation=sort_width != 0 or any(row_min_p > 0.0 for row_min_p in min_p),
            sort_width=sort_width,
            num_logprobs=max(logprobs, default=-1),
            rules=TokenRuleTensors.build(rules, output_tokens) if rules and any(rules) else None,
            constrained=any(request.structured_outputs is not None for request in params),
        )


def _to_int64(seed: int) -> int:
    """Any Python int -> the signed int64 with the same low 64 bits."""
    seed %= 1 << 64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _padded(rows: list[list], fill) -> list[list]:
    width = max((len(row) for row in rows), default=0)
    return [row + [fill] * (width - len(row)) for row in rows]


def _pad(rows: list[list[int]]) -> torch.Tensor:
    width = max((len(row) for row in rows), default=0)
    return torch.tensor(_padded(rows, -1), dtype=torch.int64, device=HOST).view(len(rows), width)


# --------------------------------------------------------------------------------------------------
# Logits processing: the target distribution
# --------------------------------------------------------------------------------------------------


def process_logits(
    logits: torch.Tensor,
    sampling: SamplingBatch,
    row_seq: torch.Tensor,
    row_extra_tokens: torch.Tensor,
    position: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of the target distribution p for each row, filtered tokens at -inf.

    logits [R, V] f32; row_seq [R] int64 (the row's sequence in `sampling`); row_extra_tokens
    [R, J] int64, -1 padded: tokens before this row that are not in sampling.output_tokens yet (the
    drafts d1..dj ahead of verify row j), counted as output tokens; position [R] int64: the
    position of the token each row produces (needed with token rules). Order: token rules,
    penalties, temperature, top-k, top-p, min-p. Greedy rows get the rules and penalties only
    (their argmax is the greedy choice). Returns [R, V] f32.
    """
    logits = logits.float()
    if sampling.rules is not None:
        logits = apply_token_rules(logits, sampling.rules, row_seq, position, row_extra_tokens)
    if sampling.any_penalty:
        logits = _apply_penalties(logits, sampling, row_seq, row_extra_tokens)
    if sampling.all_greedy:
        return logits
    temperature = sampling.temperature[row_seq]
    greedy = temperature == 0
    logits = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if not sampling.any_truncation:
        return logits
    # Greedy rows: neutral settings give them a cut-off of -inf.
    top_k = torch.where(greedy, 0, sampling.top_k[row_seq])
    top_p = torch.where(greedy, 1.0, sampling.top_p[row_seq])
    min_p = torch.where(greedy, 0.0, sampling.min_p[row_seq])
    cutoff = _truncation_cutoff(logits, top_k, top_p, min_p, sampling.sort_width)
    # In place: `logits` is our own copy here.
    return logits.masked_fill_(logits < cutoff, float("-inf"))


def apply_token_rules(
    logits: torch.Tensor,
    rules: TokenRuleTensors,
    row_seq: torch.Tensor,
    position: torch.Tensor,
    extra: torch.Tensor,
) -> torch.Tensor:
    """vLLM's per-request token rules as one additive bias and masks over [R, V] (a new tensor:
    the raw logits stay for logprobs): logit_bias added; outside allowed_token_ids, EOS and stop
    tokens before min_tokens, and a bad word's last token after the rest of it, at -inf. Column V
    absorbs the -1 padding."""
    R, V = logits.shape
    minus_inf = float("-inf")

    def slot(tokens):  # -1 padding -> the spare column V
        return torch.where(tokens < 0, V, tokens)

    widened = torch.cat([logits, logits.new_zeros(R, 1)], dim=1)
    widened.scatter_add_(1, slot(rules.bias_ids[row_seq]), rules.bias_values[row_seq])
    if rules.allowed_ids.shape[1]:
        allowed = torch.zeros(R, V + 1, dtype=torch.bool, device=logits.device)
        allowed.scatter_(1, slot(rules.allowed_ids[row_seq]), True)
        allowed |= ~rules.restricted[row_seq, None]
        widened.masked_fill_(~allowed, minus_inf)
    early = (position < rules.min_tokens_position[row_seq])[:, None]
    widened.scatter_(1, slot(torch.where(early, rules.end_ids[row_seq], -1)), minus_inf)
    if rules.reads_history:
        # The row's last L tokens: the sequence's output, then the drafts ahead of this row.
        width = rules.output_tail.shape[1]
        history = torch.cat([rules.output_tail[row_seq], extra], dim=1)
        end = width + (extra >= 0).sum(dim=1, keepdim=True)
        tail = history.gather(1, end - width + torch.arange(width, device=logits.device))
        prefixes = rules.bad_prefixes[row_seq]  # [R, W, L]
        match = ((prefixes == tail[:, None, :]) | (prefixes == ANY_TOKEN)).all(dim=-1)
        banned = torch.where(match, rules.bad_last[row_seq], -1)
        widened.scatter_(1, slot(banned), minus_inf)
    return widened[:, :V]


def _apply_penalties(
    logits: torch.Tensor, sampling: SamplingBatch, row_seq: torch.Tensor, extra: torch.Tensor
) -> torch.Tensor:
    """vLLM / OpenAI semantics: repetition over prompt + output, then frequency and presence over
    output.

    Dense per-row tables: the extra memory is bounded by the logits' own size whatever the history
    lengths. Column V absorbs the -1 padding.
    """
    R, V = logits.shape
    B = sampling.output_tokens.shape[0]

    def slot(tokens):  # -1 padding -> the spare column V
        return torch.where(tokens < 0, V, tokens)

    seq_counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
    seq_counts.scatter_add_(
        1,
        slot(sampling.output_tokens),
        torch.ones_like(sampling.output_tokens, dtype=logits.dtype),
    )
    in_prompt = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
    in_prompt.scatter_(1, slot(sampling.prompt_tokens), True)

    counts = seq_counts[row_seq]
    counts.scatter_add_(1, slot(extra), torch.ones_like(extra, dtype=logits.dtype))
    counts = counts[:, :V]
    seen = in_prompt[row_seq, :V] | (counts > 0)

    repetition = sampling.repetition_penalty[row_seq, None]
    logits = torch.where(
        seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits
    )
    frequency = sampling.frequency_penalty[row_seq, None]
    presence = sampling.presence_penalty[row_seq, None]
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def _truncation_cutoff(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, width: int
) -> torch.Tensor:
    """[R, 1] logit below which top-k, then top-p, then min-p drop a token (-inf: keep all).

    All three are value thresholds, so one comparison applies them, the result never depends on how
    a sort orders ties, and only the `width` largest logits need sorting (width >= every truncating
    row's top_k, -1 = all, 0 = no row uses top-k / top-p).
    - top-k keeps ties with the k-th logit (like HF and vLLM).
    - top-p, on the top-k-renormalised distribution, keeps each token whose strictly larger tokens
      hold less than top_p of the mass: the smallest set reaching top_p, plus ties of its last
      token; the top token always stays.
    - min-p drops p < min_p * p_max, i.e. logit < max + log(min_p) (log 0 = -inf). p / p_max does
      not change when top-k / top-p renormalise, so applying it last equals applying it to the same
      logits here.
    """
    R, V = logits.shape
    if width == 0:
        max_logit = logits.amax(dim=-1, keepdim=True)
        return max_logit + torch.log(min_p)[:, None]
    width = V if width < 0 else min(width, V)
    top = (
        logits.topk(width, dim=-1).values
        if width < V
        else logits.sort(dim=-1, descending=True).values
    )
    max_logit = top[:, :1]
    k = torch.where(top_k > 0, top_k.long(), width).clamp(1, width)
    kth = torch.where(top_k[:, None] > 0, top.gather(1, (k - 1)[:, None]), float("-inf"))
    in_k = top >= kth

    # Top-k mass, normalised over the whole vocabulary: ties with the k-th may lie beyond the sorted
    # window.
    beyond = (logits >= kth).sum(dim=-1, keepdim=True) - in_k.sum(dim=-1, keepdim=True)
    weights = torch.exp(top - max_logit) * in_k
    probs = weights / (weights.sum(dim=-1, keepdim=True) + beyond * torch.exp(kth - max_logit))
    mass_before = torch.cumsum(probs, dim=-1) - probs
    # Mass strictly above a value = the mass before the first of its ties.
    rank = torch.arange(width, device=logits.device).expand(R, width)
    first_of_ties = torch.cat([torch.ones_like(in_k[:, :1]), top[:, 1:] != top[:, :-1]], dim=1)
    mass_above = mass_before.gather(1, torch.where(first_of_ties, rank, 0).cummax(dim=-1).values)
    # top_p == 1 means off: float error in the cumsum must not trim the tail.
    # The top token always stays, whatever the float error (or a top_p that rounds to 0).
    keep = in_k & ((mass_above < top_p[:, None]) | (top_p >= 1.0)[:, None] | (rank == 0))
    truncates = ((top_k > 0) | (top_p < 1.0))[:, None]
    cutoff = torch.where(
        truncates, torch.where(keep, top, float("inf")).amin(dim=-1, keepdim=True), float("-inf")
    )
    return torch.maximum(cutoff, max_logit + torch.log(min_p)[:, None])


# --------------------------------------------------------------------------------------------------
# Choosing tokens and verifying drafts
# --------------------------------------------------------------------------------------------------


def choose(
    processed: torch.Tensor, sampling: SamplingBatch, row_seq: torch.Tensor, position: torch.Tensor
) -> torch.Tensor:
    """One token per row: argmax for greedy rows, an exact sample from softmax(processed) for the
    others.

    processed [R, V] f32 from process_logits; position [R] int64 = position of the token being
    produced (the randomness key). Returns [R] int64. torch.argmax returns the first maximum, so
    greedy ties go to the lowest id.
    """
    if sampling.all_greedy:
        return processed.argmax(-1)
    key1, key2 = row_keys(sampling.seed[row_seq], position, Stream.SAMPLE)
    sampled = sampling.temperature[row_seq] > 0
    race = _compiled_race() if processed.is_cuda and COMPILE_RACE else _race
    return race(processed, key1, key2, sampled)


def _race(
    processed: torch.Tensor, key1: torch.Tensor, key2: torch.Tensor, sampled: torch.Tensor
) -> torch.Tensor:
    """Sampled rows: the exponential race argmax(p / E), E = -log(u) ~ Exp(1), in log space as
    argmax(logit - log E) (the softmax normaliser does not move the argmax). Other rows: plain
    argmax."""
    u = uniform_from_keys(key1, key2, torch.arange(processed.shape[-1], device=processed.device))
    return torch.where(sampled[:, None], processed - torch.log(-torch.log(u)), processed).argmax(-1)


@functools.cache
def _compiled_race():
    return torch.compile(_race, dynamic=True, fullgraph=True)


@dataclass
class AcceptResult:
    tokens: torch.Tensor  # [B, K+1] int64: emitted tokens, -1 from num_emitted on
    num_emitted: torch.Tensor  # [B] int64 in 1 .. num_drafts + 1
    # Only when sampling.num_logprobs >= 0, of the raw model distribution (log_softmax of
    # unprocessed logits); entries at or after num_emitted are meaningless.
    logprobs: torch.Tensor | None = None  # [B, K+1] f32, of each emitted token
    top_ids: torch.Tensor | None = None  # [B, K+1, num_logprobs] int64
    top_logprobs: torch.Tensor | None = None  # [B, K+1, num_logprobs] f32


def accept(
    logits: torch.Tensor | None,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    first_position: torch.Tensor,
    sampling: SamplingBatch,
    chosen: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
) -> AcceptResult:
    """Verify drafts against the target and pick the tokens to emit (K = 0: plain decode / end of
    prefill).

    logits [B, K+1, V] (f32, or the model dtype: converted here where sampling, penalties or
      logprobs need f32): row j is the target's output for the input token at position
      first_position + j (the last committed token for j = 0, draft d_j after), so it predicts the
      token at first_position + j + 1, following [..., d_1, ..., d_j].
    drafts [B, K] int64 (d_1..d_K, -1 padded); num_drafts [B] int64 (rows j > num_drafts are
      padding); first_position [B] int64: position of row 0's input token.

    Row j chooses s_j (see `choose`); the longest prefix of drafts with d_{j+1} == s_j is accepted
    and s_0..s_n are emitted (n = number accepted): the accepted drafts, then one correction / bonus
    token. With sampling.argmax_only the caller may pass the rows' argmax tokens as `chosen`
    [B, K+1] instead of logits. bitmask [B * (K+1), ceil(V / 32)] int32 (grammar rows): the
    tokens each row may choose; logprobs stay those of the model.
    """
    B, K = drafts.shape
    num_rows = K + 1  # per sequence: the last committed token, then the K drafts
    device = drafts.device
    raw = flat = logits.reshape(B * num_rows, -1) if logits is not None else None
    if bitmask is not None:
        flat = apply_bitmask(flat, bitmask)
    if chosen is not None:
        assert sampling.argmax_only
    elif sampling.all_greedy and not sampling.any_penalty and sampling.rules is None:
        # The argmax needs no per-row keys, histories or f32 copy (bf16 -> f32 is exact): fewer
        # launches between decode steps, which run back to back with the step on the GPU.
        chosen = flat.argmax(-1).view(B, num_rows)
    else:
        j = torch.arange(num_rows, device=device)
        row_seq = torch.arange(B, device=device).repeat_interleave(num_rows)
        position = (first_position[:, None] + j + 1).reshape(-1)
        # Row j's history also holds d_1..d_j, which are not in sampling.output_tokens yet.
        extra = torch.where(
            torch.arange(K, device=device) < j[:, None], drafts[:, None, :], -1
        )  # [B, K+1, K]
        processed = process_logits(
            flat.float(), sampling, row_seq, extra.reshape(B * num_rows, K), position
        )
        chosen = choose(processed, sampling, row_seq, position).view(B, num_rows)

    if K == 0:  # nothing to verify: the one row's token (a plain decode step)
        num_emitted = torch.ones(B, dtype=torch.int64, device=device)
        tokens = chosen
    else:
        j = torch.arange(num_rows, device=device)
        # Accepted prefix length: cumprod of "draft matches and is a real draft" along the drafts.
        match = (drafts == chosen[:, :K]) & (j[:K] < num_drafts[:, None])
        num_emitted = match.long().cumprod(dim=1).sum(dim=1) + 1
        tokens = torch.where(j < num_emitted[:, None], chosen, -1)

    result = AcceptResult(tokens=tokens, num_emitted=num_emitted)
    if sampling.num_logprobs >= 0:
        raw = torch.log_softmax(raw.float(), dim=-1)
        result.logprobs = raw.gather(1, chosen.view(-1, 1)).view(B, num_rows)
        top_logprobs, top_ids = raw.topk(sampling.num_logprobs, dim=-1)
        result.top_ids = top_ids.view(B, num_rows, -1)
        result.top_logprobs = top_logprobs.view(B, num_rows, -1)
    return result
