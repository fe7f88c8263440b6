"""Frozen-KV MTP drafting (docs/gemma4.md §12): the draft loop, the adaptive draft length, and the
benchmark-only forced acceptance."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemma4serve.attention.metadata import AttentionMetadata
from gemma4serve.config import FULL, SLIDING
from gemma4serve.engine.args import EngineArgs
from gemma4serve.engine.random_streams import Stream, uniform
from gemma4serve.model.gemma4 import ForwardContext


class DraftLoop:
    """`num_draft_tokens` greedy drafter steps at the constant position P of each sequence.

    Seeded with the target's final-normed hidden state at P-1 and the target's scaled embedding of
    the token at P; every step reads the same committed target KV (full: rows < P; sliding: the last
    W_a + 1 rows before P) and never writes any.
    """

    def __init__(self, state):
        self.state = state

    @torch.inference_mode()
    def run(self, token, hidden, P, table_rows, tables, num_draft_tokens: int) -> torch.Tensor:
        state = self.state
        B = token.shape[0]
        metadata = AttentionMetadata(
            token_seq=table_rows,
            kv_end=P.to(torch.int32),
            page_table=tables,
            write_slot={},
            window={SLIDING: state.draft.window, FULL: 0},
            cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=token.device),
            max_q_len=1,
        )
        context = ForwardContext(metadata, state.kv, state.attn)
        rope = state.draft.rotary.cos_sin(P, hidden.dtype)  # P is fixed for the whole loop
        drafts = []
        for _ in range(num_draft_tokens):
            # the first maximum of the drafter's logits: the lowest id wins ties
            token, hidden = state.draft.greedy_step(
                state.target.embed(token), hidden, rope, context
            )
            drafts.append(token)
        return torch.stack(drafts, dim=1)


def draft_choices(num_draft_tokens: int) -> list[int]:
    """The draft lengths a step may choose besides 0, each with its own verify and draft-loop
    graphs: k and half of it (rounded up). Acceptance falls along the drafts, so at large batches
    the later drafts' verify rows cost more than they return (docs/performance.md); the half costs
    three more graphs a batch bucket (a verify graph, its greedy variant, a draft loop)."""
    return sorted({(num_draft_tokens + 1) // 2, num_draft_tokens} - {0})


@dataclass
class StepCost:
    """Seconds per step of one batch-size bucket, measured on its CUDA graphs."""

    decode: float  # one token per sequence, no drafting
    verify: dict[int, float]  # drafts per sequence d -> a step of d + 1 tokens per sequence
    draft: dict[int, float]  # d -> the draft loop proposing d drafts


class DraftLength:
    """How many drafts the next steps propose: the length among `draft_choices` (or 0, MTP off
    under heavy load) that yields the most tokens per second at the batch size
    (docs/architecture.md, adaptive draft length).

    d drafts yield 1 + the sum of the first d per-position acceptance rates tokens per verify step,
    at the cost of that step and its draft loop; no drafting yields one token per decode step. The
    rates are moving averages over the sequences' recent verify steps; they start at 1, so the full
    length is tried (and measured) first. While a shorter length is chosen, every
    `probe_every`-th step starts a probe of two full-length steps (the first proposes k drafts, the
    second verifies them), so that the rates of the later positions stay measured and recover when
    the text gets easier. Costs are the captured graphs' own replay times, so without CUDA graphs
    the draft length stays fixed.
    """

    def __init__(
        self,
        num_draft_tokens: int,
        costs: dict[int, StepCost] | None = None,
        decay: float = 0.02,
        probe_every: int = 64,
    ):
        self.num_draft_tokens = num_draft_tokens
        self.costs = costs or {}
        self.decay = decay
        self.probe_every = probe_every
        self.rates = [1.0] * num_draft_tokens
        self._short_steps = 0  # launched steps in a row below the full length
        self._probe_steps = 0  # full-length steps the current probe still takes

    def observe(self, drafted: int, accepted: int) -> None:
        """One sequence's verify step: `accepted` of its `drafted` drafts were accepted."""
        for i in range(drafted):
            self.rates[i] += self.decay * (float(i < accepted) - self.rates[i])

    def expected_tokens(self, drafts: int | None = None) -> float:
        """Tokens per verify step proposing `drafts` drafts (all of them by default)."""
        return 1.0 + sum(self.rates[:drafts])

    def choose(self, batch_size: int) -> int:
        """The draft length of a step of this many sequences; asking changes nothing (`launched`
        counts the steps)."""
        return self.num_draft_tokens if self._probe_steps else self.fastest(batch_size)

    def fastest(self, batch_size: int) -> int:
        bucket = next((size for size in sorted(self.costs) if size >= batch_size), None)
        if not self.num_draft_tokens or bucket is None:
            return self.num_draft_tokens
        cost = self.costs[bucket]
        best, best_rate = 0, 1.0 / cost.decode
        for drafts, verify in sorted(cost.verify.items()):
            rate = self.expected_tokens(drafts) / (verify + cost.draft[drafts])
            if rate > best_rate:
                best, best_rate = drafts, rate
        return best

    def launched(self, draft_len: int) -> None:
        """Count a step launched with `draft_len` drafts."""
        if draft_len == self.num_draft_tokens:
            self._short_steps = 0
            self._probe_steps = max(0, self._probe_steps - 1)
            return
        self._short_steps += 1
        if self._short_steps == self.probe_every:
            self._short_steps, self._probe_steps = 0, 2


class ForcedAcceptance:
    """Benchmark only: overrides how many drafts a verify step accepts, after the real verification
    ran.

    `profile` is either the mean tokens per verify step (bonus included, like vLLM's
    synthetic_acceptance_length) or per-position acceptance probabilities (non-increasing, e.g.
    0.8, 0.6, 0.4 = 2.8 tokens per step). The emitted tokens are then not the model's.
    """

    def __init__(self, profile, num_draft_tokens: int, device):
        if isinstance(profile, (int, float)):
            accepted = float(profile) - 1.0
            probs = [min(1.0, max(0.0, accepted - i)) for i in range(num_draft_tokens)]
        else:
            probs = sorted((float(p) for p in profile), reverse=True)[:num_draft_tokens]
            probs += [0.0] * (num_draft_tokens - len(probs))
        self.probs = torch.tensor(probs, dtype=torch.float32, device=device)

    @classmethod
    def from_args(cls, args: EngineArgs, num_draft_tokens: int, device) -> ForcedAcceptance | None:
        """--forced-acceptance where the engine drafts (every rank builds the same); else None."""
        if args.forced_acceptance is None or not num_draft_tokens:
            return None
        return cls(args.forced_acceptance, num_draft_tokens, device)

    @property
    def mean_tokens_per_step(self) -> float:
        return 1.0 + float(self.probs.sum())

    def apply(self, tokens, num_emitted, drafts, num_drafts, first_position):
        B, K = drafts.shape
        u = uniform(
            torch.zeros_like(first_position), first_position, Stream.FORCED_ACCEPTANCE, 1
        ).view(B, 1)
        num_accepted = torch.minimum((u < self.probs[None, :K]).sum(1), num_drafts)
        j = torch.arange(K + 1, device=drafts.device)
        padded = torch.cat([drafts, tokens[:, :1]], dim=1)
        bonus = tokens[:, :1].expand(B, K + 1)
        emitted = torch.where(
            j < num_accepted[:, None],
            padded,
            torch.where(j == num_accepted[:, None], bonus, -1),
        )
        return emitted, num_accepted + 1
