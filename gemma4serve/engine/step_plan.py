"""A step as rank 0 hands it to the other tensor-parallel ranks: host data only, picklable.

Every rank builds its device inputs from the same plan and runs the same forward on its shard, so
the ranks stay in step without a scheduler of their own (docs/architecture.md, "Tensor
parallelism").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gemma4serve.engine.sampler import TokenRules
from gemma4serve.engine.step_data import PromptRows, TargetBatch
from gemma4serve.sampling_params import SamplingParams


@dataclass
class SamplingPlan:
    """What `SamplingInputs` is built from: per sampling sequence, its rows and settings."""

    rows: list[list[int]]  # [B][K+1] forward rows of (last token, d_1..d_K)
    first_position: list[int]
    drafts: list[list[int]]  # [B][K] -1 padded
    drafted: list[int]
    table_rows: list[int]
    params: list[SamplingParams]
    seeds: list[int]
    output_ids: list[list[int]]
    prompt_ids: list[list[int]]
    token_rules: list[TokenRules | None]
    rows_are_all: bool

    def as_sent(self) -> SamplingPlan:
        """The plan as the workers get it: only the token histories that a penalty or a token
        rule reads (`SamplingBatch.build` reads no others), not a long prompt every step."""
        params = self.params
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        counted = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        empty = [[] for _ in params]
        return dataclasses.replace(
            self,
            output_ids=self.output_ids if repetition or counted or any(self.token_rules) else empty,
            prompt_ids=self.prompt_ids if repetition else empty,
        )


@dataclass
class ScheduledPlan:
    batch: TargetBatch  # its tensors on the host
    sampling: SamplingPlan | None  # None: the step only prefills
    prompt_rows: PromptRows | None  # as sent: without its sequences
    draft_len: int


@dataclass
class ContinuedChanges:
    """How a continued step differs from the step before it, as host data every rank rebuilds it
    from: the sequences it keeps (the others ended), the prompt chunks packed after them, and the
    sampling settings of every sequence that samples in it (the kept ones, then the prompts whose
    last chunk this is)."""

    keep: list[int] | None  # indices into the step before's sampling sequences; None: all
    prompts: TargetBatch | None  # the prompt chunks, packed (`scheduled_batch`)
    sampling_chunks: list[int]  # the prompt chunks that sample
    first_positions: list[int]  # each sampling chunk's last position
    params: list[SamplingParams]
    seeds: list[int]
    token_rules: list[TokenRules | None]


@dataclass
class ContinuedPlan:
    """The verify or decode step after the previous one, built on each rank from its own
    outputs (and `changes`, where the batch changed)."""

    page_tables: dict[str, torch.Tensor]
    draft_len: int  # drafts it proposes (it verifies as many of the previous step's)
    changes: ContinuedChanges | None = None


@dataclass
class Stop:
    """No more steps: the worker leaves its loop."""
