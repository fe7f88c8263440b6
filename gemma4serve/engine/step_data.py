"""What crosses a step: the packed target batch and the rows it samples, the target's and the
step's device outputs, and the handle of a launched step with its pinned host copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemma4serve.config import FULL
from gemma4serve.engine.outputs import TokenLogprob
from gemma4serve.engine.sampler import SamplingBatch
from gemma4serve.engine.sequence import Sequence, StepResult


@dataclass
class TargetBatch:
    """The packed query rows of one target forward: one group of consecutive rows per sequence."""

    token_ids: torch.Tensor  # [T] int64, on the host (scheduled steps) or the device (continued)
    positions: torch.Tensor  # [T] int64, beside token_ids
    page_tables: dict[str, torch.Tensor]  # host, kind -> [G, pages] int32
    # Rows of every group when the step is decode-shaped (each group: one token plus its drafts), so
    # a CUDA graph can run it; None for steps that carry prefill chunks.
    decode_query_len: int | None
    group_starts: torch.Tensor | None = None  # host [G+1] int32; None: groups of decode_query_len
    # host [G] int32: each group's last position + 1; None where those are on the device only
    key_lengths: torch.Tensor | None = None
    # host [G] int32: how many of each group's last rows are read after the forward (sampled, or
    # scoring the prompt); None: every row
    readout: torch.Tensor | None = None
    # the most positions a prompt chunk of the step reaches (0: none); it picks attention tiles
    chunk_context: int = 0

    @property
    def num_groups(self) -> int:
        return self.page_tables[FULL].shape[0]

    def readout_counts(self) -> torch.Tensor:
        """Host [G] int32: how many of each group's last rows are read (a packed batch's)."""
        return self.readout if self.readout is not None else self.group_starts.diff()


@dataclass
class SamplingInputs:
    """The rows a step samples from: 1 + drafts rows per sequence that produces tokens."""

    sequences: list[Sequence]
    rows: torch.Tensor  # [B, K+1] forward row of (last token, d_1..d_K); short groups repeat a row
    first_position: torch.Tensor  # [B] position of each group's first row
    drafts: torch.Tensor  # [B, K] -1 padded
    num_drafts: torch.Tensor  # [B]
    table_rows: torch.Tensor  # [B] int32: each sequence's page-table row
    sampling: SamplingBatch
    drafted: list[int]  # host copy of num_drafts
    rows_are_all: bool = False  # rows.view(-1) is every forward row in order: no gather needed


@dataclass
class TargetOutputs:
    """The target forward's results; a CUDA graph also ends in the logits or the greedy tokens."""

    hidden: torch.Tensor  # [T, H] final-normed hidden states (of the batch's read-out rows)
    logits: torch.Tensor | None  # [T, V]
    greedy_tokens: torch.Tensor | None  # [T]
    page_tables: dict[str, torch.Tensor]  # the device tables the draft loop reads
    graphed: bool


@dataclass
class StepOutputs:
    """A launched step's device outputs."""

    tokens: torch.Tensor  # [B, K+1] emitted tokens, -1 past num_emitted
    num_emitted: torch.Tensor  # [B]
    next_drafts: torch.Tensor | None  # [B, draft_len] proposals for the next step


class PinnedColumns:
    """Device tensors [B, n_i] of one dtype copied to pinned host memory at once, read by name."""

    def __init__(self, parts: dict[str, torch.Tensor]):
        self.columns: dict[str, slice] = {}
        start = 0
        for name, part in parts.items():
            self.columns[name] = slice(start, start + part.shape[1])
            start += part.shape[1]
        self.host = to_host(torch.cat(list(parts.values()), dim=1))

    def rows(self) -> list[dict[str, list]]:
        return [
            {name: row[cols] for name, cols in self.columns.items()} for row in self.host.tolist()
        ]


@dataclass
class PinnedLogprobs:
    chosen: torch.Tensor  # [B, K+1] logprob of each emitted token
    top_ids: torch.Tensor  # [B, K+1, W] the W best tokens of each row, best first
    top_logprobs: torch.Tensor  # [B, K+1, W]

    def token_logprobs(self):
        """A reader (sequence index, its emitted tokens, top-n wanted) -> [TokenLogprob]."""
        chosen = self.chosen.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()

        def read(i: int, tokens: list[int], wanted: int) -> list[TokenLogprob]:
            return [
                TokenLogprob(
                    token,
                    chosen[i][j],
                    list(zip(top_ids[i][j][:wanted], top_logprobs[i][j][:wanted])),
                )
                for j, token in enumerate(tokens)
            ]

        return read


@dataclass
class PromptRows:
    """The rows of a step whose logits score the next prompt token, for requests that want
    prompt logprobs (chosen on the host when the step is built)."""

    sequences: list[Sequence]  # per row (empty on tensor-parallel workers: they read nothing)
    positions: list[int]  # per row: the position of the prompt token it scores
    rows: torch.Tensor  # [P] int64 on the host: rows of the forward
    targets: torch.Tensor  # [P] int64 on the host: the prompt token each row scores
    width: int  # the most top logprobs any of them wants


@dataclass
class PinnedPromptLogprobs:
    rows: PromptRows
    chosen: torch.Tensor  # [P] logprob of the prompt token
    rank: torch.Tensor  # [P] int64
    top_ids: torch.Tensor  # [P, width]
    top_logprobs: torch.Tensor  # [P, width]

    def read(self) -> dict[Sequence, list[tuple[int, TokenLogprob]]]:
        chosen, rank = self.chosen.tolist(), self.rank.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        targets = self.rows.targets.tolist()
        out: dict[Sequence, list[tuple[int, TokenLogprob]]] = {}
        for i, (seq, position) in enumerate(zip(self.rows.sequences, self.rows.positions)):
            wanted = seq.params.prompt_logprobs
            entry = TokenLogprob(
                targets[i],
                chosen[i],
                list(zip(top_ids[i][:wanted], top_logprobs[i][:wanted])),
                rank=rank[i],
            )
            out.setdefault(seq, []).append((position, entry))
        return out


@dataclass
class PendingSampling:
    """A continued constrained step queued up to its target forward: its accept, draft loop and
    copy wait for the grammar bitmask, which needs the step before it committed on the host."""

    target: TargetOutputs


@dataclass
class StepHandle:
    """A launched step: its device outputs and their copy to the host (read by `results()`)."""

    inputs: SamplingInputs | None  # None: the step only prefilled, nothing to read
    outputs: StepOutputs | None = None
    draft_len: int = 0  # drafts this step proposes for the next one
    continuable: bool = False  # some sequences sample: `launch_continued` can follow it
    pending: PendingSampling | None = None  # set: `ModelRunner.sample_continued` must finish it
    _ints: PinnedColumns | None = None
    _logprobs: PinnedLogprobs | None = None
    _done: torch.cuda.Event | None = None
    _prompt_logprobs: PinnedPromptLogprobs | None = None

    def prompt_logprobs(self) -> dict[Sequence, list[tuple[int, TokenLogprob]]]:
        """Wait for the step; {sequence: [(position, logprob of its prompt token there)]}."""
        if self._prompt_logprobs is None:
            return {}
        if self._done is not None:
            self._done.synchronize()
        return self._prompt_logprobs.read()

    @property
    def sequences(self) -> list[Sequence]:
        return self.inputs.sequences if self.inputs is not None else []

    def results(self) -> dict[Sequence, StepResult]:
        """Wait for the step; {sequence: StepResult} for the sequences it produced tokens for."""
        if self.inputs is None:
            return {}
        if self._done is not None:
            self._done.synchronize()
        token_logprobs = self._logprobs.token_logprobs() if self._logprobs is not None else None
        out = {}
        for i, (seq, row) in enumerate(zip(self.inputs.sequences, self._ints.rows())):
            n = row["num_emitted"][0]
            tokens = row["tokens"][:n]
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = token_logprobs(i, tokens, seq.params.logprobs)
            out[seq] = StepResult(
                tokens=tokens,
                next_drafts=row["next_drafts"],
                num_drafted=self.inputs.drafted[i],
                logprobs=logprobs,
            )
        return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, queued without waiting (a host tensor as it is)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
