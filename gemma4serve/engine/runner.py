"""Runs one scheduled step on the device: packed target forward, verification, and the draft loop.

A step is launched, not awaited. The host builds its inputs (token ids, positions, page tables, sampling
settings) and queues the target forward, acceptance, the k-step draft loop and one copy of the results into
pinned host memory; `StepHandle.results()` waits for that copy. A pure decode step can be continued on the
device (`launch_next`): the next step's token ids and positions are taken from this step's outputs, so the
host queues it before it has read them, and reads them while the GPU runs it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from gemma4serve.attention.metadata import HostBatch, causal_metadata, page_tables, to_device
from gemma4serve.config import FULL, SLIDING
from gemma4serve.engine.cuda_graphs import CudaGraphs
from gemma4serve.engine.models import ModelState
from gemma4serve.engine.sampler import SamplingBatch, accept
from gemma4serve.engine.sequence import ScheduledChunk, Sequence, StepResult
from gemma4serve.engine.spec import DraftLoop, ForcedAcceptance
from gemma4serve.kv.manager import SeqPages
from gemma4serve.model.gemma4 import ForwardContext


@dataclass
class SamplingInputs:
    """The rows a step samples from, one group per sequence that produces tokens (all on the device)."""

    seqs: list[Sequence]
    rows: (
        torch.Tensor
    )  # [B, K+1] packed row of (last token, d_1..d_k); short groups repeat their last row
    first_pos: torch.Tensor  # [B] position of each group's first row
    drafts: torch.Tensor  # [B, K] -1 padded
    num_drafts: torch.Tensor  # [B]
    table_rows: torch.Tensor  # [B] int32: each sequence's page-table row
    sb: SamplingBatch
    all_rows: bool = (
        False  # rows.view(-1) is every row of the forward, in order (so no gather is needed)
    )


@dataclass
class StepHandle:
    """A launched step: its device outputs, and their copy to the host (in flight until `results()`)."""

    inputs: SamplingInputs | None
    tokens: torch.Tensor | None = None  # [B, K+1] emitted tokens, -1 past num_emitted
    num_emitted: torch.Tensor | None = None  # [B]
    next_drafts: torch.Tensor | None = None  # [B, k]
    drafted: list[int] = ()  # per sequence: the drafts this step verified
    draft_len: int = 0  # drafts this step proposes for the next one (next_drafts' width)
    continuable: bool = False  # a pure decode step that `launch_next` can follow
    _ints: torch.Tensor | None = None
    _floats: torch.Tensor | None = None
    _done: torch.cuda.Event | None = None
    _top_width: int = 0  # top-logprob slots per emitted token

    @property
    def seqs(self) -> list[Sequence]:
        return self.inputs.seqs if self.inputs is not None else []

    def results(self) -> dict:
        """Wait for the step; {sequence: StepResult} for the sequences it produced tokens for."""
        if self.inputs is None:
            return {}
        if self._done is not None:
            self._done.synchronize()
        rows = self._ints.tolist()
        floats = self._floats.tolist() if self._floats is not None else None
        K1 = self.tokens.shape[1]
        k = self.next_drafts.shape[1] if self.next_drafts is not None else 0
        width = self._top_width
        out = {}
        for i, seq in enumerate(self.inputs.seqs):
            row = rows[i]
            n = row[K1]
            lp = None
            if floats is not None and seq.params.logprobs is not None:
                top_ids, top_lps, want = row[K1 + 1 + k :], floats[i][K1:], seq.params.logprobs
                lp = [
                    (
                        floats[i][j],
                        list(
                            zip(
                                top_ids[j * width : j * width + want],
                                top_lps[j * width : j * width + want],
                            )
                        ),
                    )
                    for j in range(n)
                ]
            out[seq] = StepResult(tokens=row[:n], next_drafts=row[K1 + 1 : K1 + 1 + k], logprobs=lp)
        return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def pack_chunks(chunks: list[ScheduledChunk]):
    """Host-side: token ids, positions, owning group and group offsets of a step's packed query rows."""
    ids, positions, token_seq, cu = [], [], [], [0]
    for b, ch in enumerate(chunks):
        ids += ch.seq.token_ids[ch.start : ch.start + ch.length] + ch.drafts
        positions += range(ch.start, ch.start + ch.num_query)
        token_seq += [b] * ch.num_query
        cu.append(cu[-1] + ch.num_query)
    return ids, positions, token_seq, cu


class ModelRunner:
    def __init__(
        self,
        state: ModelState,
        num_draft_tokens: int,
        forced: ForcedAcceptance | None = None,
        graphs: CudaGraphs | None = None,
    ):
        self.s = state
        self.k = num_draft_tokens  # 0 without a drafter (the engine decides)
        self.draft_loop = DraftLoop(state) if self.k else None
        self.forced = forced
        self.graphs = graphs
        self.window = {SLIDING: state.target.cfg.sliding_window, FULL: 0}
        self._continuation_index: dict[tuple[int, int], tuple] = {}

    def prepare(self, chunks: list[ScheduledChunk]):
        """Host -> device: the packed token ids, positions and attention metadata of a step."""
        dev = self.s.device
        ids, positions, token_seq, cu = pack_chunks(chunks)
        pos_t = to_device(torch.tensor(positions, dtype=torch.int64), dev)
        host_tables = page_tables([ch.seq.pages for ch in chunks])
        cu_t = torch.tensor(cu, dtype=torch.int32)
        kv_len = torch.tensor([ch.start + ch.num_query for ch in chunks], dtype=torch.int32)
        host = HostBatch(cu_t, kv_len, host_tables)
        meta = causal_metadata(
            to_device(torch.tensor(token_seq, dtype=torch.int32), dev),
            pos_t,
            {kind: to_device(t, dev) for kind, t in host_tables.items()},
            self.window,
            to_device(cu_t, dev),
            max(ch.num_query for ch in chunks),
            self.s.page_size,
            host,
        )
        return to_device(torch.tensor(ids, dtype=torch.int64), dev), pos_t, meta

    def _sampling_inputs(self, chunks: list[ScheduledChunk]) -> SamplingInputs | None:
        """Host -> device for verification and drafting, built before the forward is queued."""
        dev = self.s.device
        sampling = [(b, ch) for b, ch in enumerate(chunks) if ch.samples]
        if not sampling:
            return None
        K = max(len(ch.drafts) for _, ch in sampling)
        ends = list(itertools.accumulate(ch.num_query for ch in chunks))
        rows, first_pos, drafts, num_drafts = [], [], [], []
        for b, ch in sampling:
            nd = len(ch.drafts)
            first = ends[b] - nd - 1
            rows.append([first + min(j, nd) for j in range(K + 1)])
            first_pos.append(ch.start + ch.length - 1)
            drafts.append(ch.drafts + [-1] * (K - nd))
            num_drafts.append(nd)
        seqs = [ch.seq for _, ch in sampling]
        flat = [r for row in rows for r in row]

        def i64(x):
            return to_device(torch.tensor(x, dtype=torch.int64), dev)

        return SamplingInputs(
            seqs=seqs,
            rows=i64(rows),
            first_pos=i64(first_pos),
            drafts=i64(drafts).view(len(sampling), K),
            num_drafts=i64(num_drafts),
            table_rows=to_device(torch.tensor([b for b, _ in sampling], dtype=torch.int32), dev),
            sb=SamplingBatch.build(
                [q.params for q in seqs],
                [q.seed for q in seqs],
                [q.output_ids for q in seqs],
                [q.token_ids[: q.num_prompt] for q in seqs],
                dev,
            ),
            all_rows=flat == list(range(ends[-1])),
        )

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], draft_len: int) -> StepHandle:
        """Queue a scheduled step that proposes `draft_len` (0 or k) drafts for the next one."""
        s = self.s
        inp = self._sampling_inputs(chunks)
        Q = chunks[0].num_query
        decode = all(ch.length == 1 and ch.samples and ch.num_query == Q for ch in chunks)
        graphed = (
            self.graphs is not None
            and decode
            and self.graphs.fits(len(chunks), Q, max(len(ch.seq.pages.full) for ch in chunks))
        )
        if graphed:
            ids, positions, _, _ = pack_chunks(chunks)
            hidden, logits, chosen = self.graphs.run_target(
                torch.tensor(ids),
                torch.tensor(positions),
                Q,
                page_tables([ch.seq.pages for ch in chunks]),
                greedy=inp is not None and inp.sb.argmax_only,
            )
            tables = self.graphs.tables
        else:
            ids_t, pos_t, meta = self.prepare(chunks)
            hidden = s.target(ids_t, pos_t, ForwardContext(meta, s.kv, s.attn))
            logits, chosen, tables = None, None, meta.page_table
        if inp is None:
            return StepHandle(None)
        drafted = [len(ch.drafts) for ch in chunks if ch.samples]
        return self._verify_and_draft(
            inp,
            hidden,
            logits,
            chosen,
            tables,
            graphed,
            drafted,
            draft_len,
            decode and not inp.sb.any_penalty,
        )

    @torch.inference_mode()
    def launch_next(self, prev: StepHandle, pages: list[SeqPages]) -> StepHandle:
        """Queue the decode step that follows `prev` for the same sequences, from its device outputs: each
        sequence's newest token and next drafts at the positions after its emitted tokens; it proposes as
        many drafts again. `pages` must already map every position that step can write."""
        dev = self.s.device
        B, Q = prev.tokens.shape[0], prev.draft_len + 1
        rows, num_drafts, table_rows, offsets = self._continuation_indices(B, Q)
        P = prev.inputs.first_pos + prev.num_emitted  # position of each newest token
        if prev.draft_len:
            newest = prev.tokens.gather(1, (prev.num_emitted - 1)[:, None])
            ids = torch.cat([newest, prev.next_drafts], dim=1)
            pos = P[:, None] + offsets
        else:
            # One token a step, the newest (prev.tokens may be the last replay's graph output: it is copied into
            # the graph's inputs before the next replay).
            ids, pos = prev.tokens, P[:, None]
        host_tables = page_tables(pages)
        graphed = self.graphs is not None and self.graphs.fits(
            B, Q, max(len(p.full) for p in pages)
        )
        if graphed:
            hidden, logits, chosen = self.graphs.run_target(
                ids.view(-1), pos.view(-1), Q, host_tables, greedy=prev.inputs.sb.argmax_only
            )
            tables = self.graphs.tables
        else:
            s = self.s
            tables = {kind: to_device(t, dev) for kind, t in host_tables.items()}
            token_seq = torch.div(
                torch.arange(B * Q, device=dev, dtype=torch.int32), Q, rounding_mode="floor"
            )
            cu = torch.arange(0, B * Q + 1, Q, device=dev, dtype=torch.int32)
            meta = causal_metadata(token_seq, pos.view(-1), tables, self.window, cu, Q, s.page_size)
            hidden = s.target(ids.view(-1), pos.view(-1), ForwardContext(meta, s.kv, s.attn))
            logits = chosen = None
        # The drafts as copied into `ids`: `prev.next_drafts` is a graph output, and graphs share one memory
        # pool, so the target replay below may overwrite it.
        drafts = ids[:, 1:]
        inp = SamplingInputs(
            seqs=prev.inputs.seqs,
            rows=rows,
            first_pos=P,
            drafts=drafts,
            num_drafts=num_drafts,
            table_rows=table_rows,
            sb=prev.inputs.sb,
            all_rows=True,
        )
        return self._verify_and_draft(
            inp, hidden, logits, chosen, tables, graphed, [Q - 1] * B, prev.draft_len, True
        )

    def _continuation_indices(self, B: int, Q: int) -> tuple:
        """(rows [B, Q], num_drafts [B], table_rows [B], offsets [Q]): the same for every continued step of B
        sequences x Q rows, so made once (each would be a launch between two steps; nothing writes them)."""
        if (B, Q) not in self._continuation_index:
            dev = self.s.device
            self._continuation_index[(B, Q)] = (
                torch.arange(B * Q, device=dev).view(B, Q),
                torch.full((B,), Q - 1, device=dev, dtype=torch.int64),
                torch.arange(B, device=dev, dtype=torch.int32),
                torch.arange(Q, device=dev),
            )
        return self._continuation_index[(B, Q)]

    def _verify_and_draft(
        self,
        inp: SamplingInputs,
        hidden,
        all_logits,
        all_chosen,
        tables,
        graphed: bool,
        drafted: list[int],
        draft_len: int,
        continuable: bool,
    ) -> StepHandle:
        """Device-only from here: accept, draft the next tokens, queue the copy of the results to the host.
        all_logits / all_chosen: a graph's logits or greedy tokens of every row (None: computed here)."""
        s = self.s
        rows, first_pos, drafts, num_drafts = inp.rows, inp.first_pos, inp.drafts, inp.num_drafts
        B, K1 = rows.shape
        flat_rows = rows.view(-1)

        def sampled(t):  # the sampled rows of a tensor over the forward's rows
            return t if inp.all_rows else t[flat_rows]

        logits = chosen = None
        if all_chosen is not None:
            chosen = sampled(all_chosen)
        elif all_logits is not None:
            logits = sampled(all_logits)
        elif inp.sb.argmax_only:
            chosen = s.target.greedy(sampled(hidden))
        else:
            logits = s.target.logits(sampled(hidden))
        res = accept(
            logits.view(B, K1, -1) if logits is not None else None,
            drafts,
            num_drafts,
            first_pos,
            inp.sb,
            chosen.view(B, K1) if chosen is not None else None,
        )
        tokens, num_emitted = res.tokens, res.num_emitted
        if self.forced is not None and K1 > 1:
            tokens, num_emitted = self.forced.apply(
                tokens, num_emitted, drafts, num_drafts, first_pos
            )

        next_drafts = None
        if draft_len:
            last = (num_emitted - 1)[:, None]
            seed_hidden = hidden[rows.gather(1, last).squeeze(1)]
            seed_token = tokens.gather(1, last).squeeze(1)
            P = first_pos + num_emitted  # position of the newest token; rows < P are committed
            if graphed:
                next_drafts = self.graphs.run_draft(seed_token, seed_hidden, P, inp.table_rows)
            else:
                next_drafts = self.draft_loop.run(
                    seed_token, seed_hidden, P, inp.table_rows, tables, draft_len
                )

        parts = [tokens, num_emitted[:, None]] + ([next_drafts] if next_drafts is not None else [])
        floats, top_width = None, 0
        if res.logprobs is not None:
            parts.append(res.top_ids.flatten(1))
            floats = _to_host(torch.cat([res.logprobs, res.top_logprobs.flatten(1)], dim=1))
            top_width = res.top_ids.shape[-1]
        ints = _to_host(torch.cat(parts, dim=1))
        done = None
        if s.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return StepHandle(
            inp,
            tokens,
            num_emitted,
            next_drafts,
            drafted,
            draft_len,
            continuable,
            ints,
            floats,
            done,
            top_width,
        )
