"""Runs one scheduled step on the device: packed target forward, verification, and the draft loop.

The host builds the step's tensors first (token ids, positions, page tables, write slots, sampling settings);
everything after that — target forward, logits of the sampling rows, acceptance, seeding and running the
k-step draft loop — is queued on the device, and the step ends with one copy of the results to the host.
"""

from __future__ import annotations

import itertools

import torch

from gemma4serve.attention.metadata import AttentionMetadata
from gemma4serve.config import FULL, SLIDING
from gemma4serve.engine.sampler import SamplingBatch, accept
from gemma4serve.engine.sequence import ScheduledChunk, StepResult
from gemma4serve.engine.spec import DraftLoop, ForcedAcceptance
from gemma4serve.engine.cuda_graphs import CudaGraphs
from gemma4serve.engine.models import ModelState
from gemma4serve.model.gemma4 import ForwardContext


class ModelRunner:
    def __init__(self, state: ModelState, num_draft_tokens: int, forced: ForcedAcceptance | None = None,
                 graphs: CudaGraphs | None = None):
        self.s = state
        self.k = num_draft_tokens  # 0 without a drafter (the engine decides)
        self.draft_loop = DraftLoop(state) if self.k else None
        self.forced = forced
        self.graphs = graphs

    def _tables(self, chunks: list[ScheduledChunk]) -> dict:
        dev = self.s.device
        out = {}
        for kind, attr in ((FULL, "full"), (SLIDING, "sliding")):
            rows = [getattr(ch.seq.pages, attr) for ch in chunks]
            width = max(1, max(len(r) for r in rows))
            out[kind] = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=dev)
        return out

    def prepare(self, chunks: list[ScheduledChunk]):
        """Host -> device: the packed token ids, positions and attention metadata of a step."""
        s, dev, ps = self.s, self.s.device, self.s.page_size
        ids, positions, token_seq, cu = [], [], [], [0]
        for b, ch in enumerate(chunks):
            ids += ch.seq.token_ids[ch.start : ch.start + ch.length] + ch.drafts
            positions += range(ch.start, ch.start + ch.num_query)
            token_seq += [b] * ch.num_query
            cu.append(cu[-1] + ch.num_query)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        seq_t = torch.tensor(token_seq, dtype=torch.int32, device=dev)
        tables = self._tables(chunks)
        write_slot = {kind: t[seq_t.long(), pos_t // ps].long() * ps + pos_t % ps for kind, t in tables.items()}
        meta = AttentionMetadata(
            token_seq=seq_t,
            kv_end=(pos_t + 1).to(torch.int32),
            page_table=tables,
            write_slot=write_slot,
            window={SLIDING: s.target.cfg.sliding_window, FULL: 0},
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_q_len=max(ch.num_query for ch in chunks),
        )
        return ids_t, pos_t, meta

    def _sampling_inputs(self, chunks: list[ScheduledChunk]) -> dict | None:
        """Host -> device for verification and drafting. Built before the forward is launched: a copy from
        pageable host memory waits for the stream to drain, so made after it, it would idle the GPU."""
        dev = self.s.device
        sampling = [(b, ch) for b, ch in enumerate(chunks) if ch.samples]
        if not sampling:
            return None
        K = max(len(ch.drafts) for _, ch in sampling)
        ends = list(itertools.accumulate(ch.num_query for ch in chunks))
        # Row j of a sampling chunk is its (last token, d_1..d_k) query row j; pad by repeating the last row.
        rows, first_pos, drafts, num_drafts = [], [], [], []
        for b, ch in sampling:
            nd = len(ch.drafts)
            first = ends[b] - nd - 1
            rows.append([first + min(j, nd) for j in range(K + 1)])
            first_pos.append(ch.start + ch.length - 1)
            drafts.append(ch.drafts + [-1] * (K - nd))
            num_drafts.append(nd)
        seqs = [ch.seq for _, ch in sampling]

        def i64(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)

        return dict(
            seqs=seqs,
            rows=i64(rows),
            first_pos=i64(first_pos),
            drafts=i64(drafts).view(len(sampling), K),
            num_drafts=i64(num_drafts),
            table_rows=torch.tensor([b for b, _ in sampling], dtype=torch.int32, device=dev),
            sb=SamplingBatch.build(
                [q.params for q in seqs], [q.seed for q in seqs], [q.output_ids for q in seqs],
                [q.token_ids[: q.num_prompt] for q in seqs], dev,
            ),
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> dict:
        """Run the step; returns {sequence: StepResult} for the chunks that produce tokens."""
        s = self.s
        inp = self._sampling_inputs(chunks)
        graphed = self.graphs is not None and self.graphs.can_run(chunks)
        if graphed:
            hidden, all_logits = self.graphs.run_target(chunks)
        else:
            ids_t, pos_t, meta = self.prepare(chunks)
            hidden = s.target(ids_t, pos_t, ForwardContext(meta, s.kv, s.attn))
        if inp is None:
            return {}
        # From here on only device work is queued until the results are copied back.
        rows, first_pos, drafts, num_drafts = inp["rows"], inp["first_pos"], inp["drafts"], inp["num_drafts"]
        B, K1 = rows.shape
        flat_rows = rows.view(-1)
        logits = all_logits[flat_rows] if graphed else s.target.logits(hidden[flat_rows])
        res = accept(logits.float().view(B, K1, -1), drafts, num_drafts, first_pos, inp["sb"])
        tokens, num_emitted = res.tokens, res.num_emitted
        if self.forced is not None and K1 > 1:
            tokens, num_emitted = self.forced.apply(tokens, num_emitted, drafts, num_drafts, first_pos)

        next_drafts = None
        if self.k:
            last = (num_emitted - 1)[:, None]
            seed_hidden = hidden[rows.gather(1, last).squeeze(1)]
            seed_token = tokens.gather(1, last).squeeze(1)
            P = first_pos + num_emitted  # position of the newest token; rows < P are committed
            if graphed:
                next_drafts = self.graphs.run_draft(seed_token, seed_hidden, P, inp["table_rows"])
            else:
                next_drafts = self.draft_loop.run(seed_token, seed_hidden, P, inp["table_rows"], meta.page_table,
                                                  self.k)
        return self._results(inp["seqs"], tokens, num_emitted, next_drafts, res)

    @staticmethod
    def _results(seqs, tokens, num_emitted, next_drafts, res) -> dict:
        """The step's device -> host copy (one for the token ids, one more only when logprobs are asked for)."""
        K1 = tokens.shape[1]
        parts = [tokens, num_emitted[:, None]]
        if next_drafts is not None:
            parts.append(next_drafts)
        want_lp = res.logprobs is not None
        if want_lp:
            parts.append(res.top_ids.flatten(1))
            floats = torch.cat([res.logprobs, res.top_logprobs.flatten(1)], dim=1).tolist()
        rows = torch.cat(parts, dim=1).tolist()
        k = next_drafts.shape[1] if next_drafts is not None else 0
        width = res.top_ids.shape[-1] if want_lp else 0  # top-logprob slots per emitted token
        out = {}
        for i, seq in enumerate(seqs):
            row = rows[i]
            n = row[K1]
            lp = None
            if want_lp and seq.params.logprobs is not None:
                top_ids, top_lps = row[K1 + 1 + k:], floats[i][K1:]
                want = seq.params.logprobs
                lp = [
                    (floats[i][j], list(zip(top_ids[j * width: j * width + want], top_lps[j * width: j * width + want])))
                    for j in range(n)
                ]
            out[seq] = StepResult(tokens=row[:n], next_drafts=row[K1 + 1: K1 + 1 + k], logprobs=lp)
        return out
