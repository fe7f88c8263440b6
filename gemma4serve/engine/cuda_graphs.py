"""CUDA graphs for the steady state: the target's decode/verify forward (with the logits of every row) and
the whole k-step draft loop, each captured once per batch-size bucket.

A decode step of B sequences with d drafts each is B groups of Q = d + 1 query tokens. Its inputs are
copied into static buffers (rows past B point at a dummy page-table row of null pages and write into the
null page 0), the graph for the smallest bucket >= B is replayed, and the first B*Q rows of the outputs are
the step's. Steps that carry prefill chunks, or uneven draft counts, run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from gemma4serve.attention.metadata import AttentionMetadata
from gemma4serve.config import FULL, SLIDING
from gemma4serve.engine.spec import DraftLoop
from gemma4serve.model.gemma4 import ForwardContext

log = logging.getLogger("gemma4serve")


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [b for b in sizes if b < max_batch] + [max_batch]


class CudaGraphs:
    def __init__(self, state, max_batch: int, max_model_len: int, num_draft_tokens: int):
        self.s = state
        self.k = num_draft_tokens
        self.buckets = batch_buckets(max_batch)
        self.q_lens = sorted({1, num_draft_tokens + 1})
        B, T = self.buckets[-1], self.buckets[-1] * max(self.q_lens)
        dev, ps = state.device, state.page_size
        width = -(-(max_model_len + num_draft_tokens + 1) // ps) + 1
        self.dummy_row = B  # a page-table row of null pages for padding
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self.ids = torch.zeros(T, **i64)
        self.pos = torch.zeros(T, **i64)
        self.token_seq = torch.full((T,), B, **i32)
        self.kv_end = torch.ones(T, **i32)
        self.slots = {FULL: torch.zeros(T, **i64), SLIDING: torch.zeros(T, **i64)}
        self.tables = {FULL: torch.zeros(B + 1, width, **i32), SLIDING: torch.zeros(B + 1, width, **i32)}
        self.width = width
        # Built once and kept: a tensor a graph reads must outlive the capture (its memory is not the graph's).
        self.cu_seqlens = {q: torch.arange(0, B * q + 1, q, **i32) for q in self.q_lens}
        H = state.target.cfg.hidden_size
        self.d_token = torch.zeros(B, **i64)
        self.d_hidden = torch.zeros(B, H, dtype=state.dtype, device=dev)
        self.d_pos = torch.ones(B, **i64)
        self.d_rows = torch.full((B,), B, **i32)
        self.pool = torch.cuda.graph_pool_handle()
        self.target_graphs: dict = {}  # (B, Q) -> (graph, hidden, logits)
        self.draft_graphs: dict = {}  # B -> (graph, drafts)
        self.draft_loop = DraftLoop(state) if (state.draft is not None and num_draft_tokens) else None

    # ---- capture --------------------------------------------------------------------------------------

    def _meta(self, B: int, Q: int) -> AttentionMetadata:
        T = B * Q
        return AttentionMetadata(
            token_seq=self.token_seq[:T],
            kv_end=self.kv_end[:T],
            page_table=self.tables,
            write_slot={kind: s[:T] for kind, s in self.slots.items()},
            window={SLIDING: self.s.target.cfg.sliding_window, FULL: 0},
            cu_seqlens_q=self.cu_seqlens[Q][: B + 1],
            max_q_len=Q,
        )

    def _target_fn(self, B: int, Q: int):
        s, T = self.s, B * Q
        meta = self._meta(B, Q)

        def run():
            hidden = s.target(self.ids[:T], self.pos[:T], ForwardContext(meta, s.kv, s.attn))
            return hidden, s.target.logits(hidden)

        return run

    def _draft_fn(self, B: int):
        def run():
            return self.draft_loop.run(self.d_token[:B], self.d_hidden[:B], self.d_pos[:B], self.d_rows[:B],
                                       self.tables, self.k)

        return run

    def _capture(self, fn):
        torch.cuda.synchronize()
        fn()  # warm up: compile Triton kernels, pick cuBLAS algorithms
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.monotonic()
        for B in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            for Q in self.q_lens:
                graph, (hidden, logits) = self._capture(self._target_fn(B, Q))
                self.target_graphs[(B, Q)] = (graph, hidden, logits)
            if self.draft_loop is not None:
                graph, drafts = self._capture(self._draft_fn(B))
                self.draft_graphs[B] = (graph, drafts)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (batch buckets %s) in %.1fs",
                 len(self.target_graphs) + len(self.draft_graphs), self.buckets, time.monotonic() - t0)

    # ---- replay ---------------------------------------------------------------------------------------

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def can_run(self, chunks) -> bool:
        if not chunks or self.bucket(len(chunks)) is None:
            return False
        q = chunks[0].num_query
        return q in self.q_lens and all(
            ch.length == 1 and ch.num_query == q and ch.samples and len(ch.seq.pages.full) < self.width
            for ch in chunks
        )

    def run_target(self, chunks):
        """Replay the decode/verify graph for these chunks -> (hidden [T, H], logits [T, V])."""
        n, Q = len(chunks), chunks[0].num_query
        B = self.bucket(n)
        ps = self.s.page_size
        ids, pos, tables = [], [], {FULL: [], SLIDING: []}
        for ch in chunks:
            ids += [ch.seq.token_ids[ch.start]] + ch.drafts
            pos += range(ch.start, ch.start + Q)
            tables[FULL].append(ch.seq.pages.full)
            tables[SLIDING].append(ch.seq.pages.sliding)
        T = n * Q
        self.ids[:T].copy_(torch.tensor(ids), non_blocking=True)
        pos_t = torch.tensor(pos, dtype=torch.int64)
        self.pos[:T].copy_(pos_t, non_blocking=True)
        self.kv_end[:T].copy_(pos_t + 1, non_blocking=True)
        seq_of = torch.arange(n, dtype=torch.int32).repeat_interleave(Q)
        self.token_seq[:T].copy_(seq_of, non_blocking=True)
        # Padding rows: the dummy table row, one visible key, writes into the null page.
        self.token_seq[T : B * Q].fill_(self.dummy_row)
        self.kv_end[T : B * Q].fill_(1)
        for kind, rows in tables.items():
            w = max(len(r) for r in rows)
            host = torch.tensor([r + [0] * (w - len(r)) for r in rows], dtype=torch.int32)
            self.tables[kind][:n, :w].copy_(host, non_blocking=True)
            slots = host[seq_of.long(), pos_t // ps].long() * ps + pos_t % ps
            self.slots[kind][:T].copy_(slots, non_blocking=True)
            self.slots[kind][T : B * Q].zero_()
        graph, hidden, logits = self.target_graphs[(B, Q)]
        graph.replay()
        return hidden[:T], logits[:T]

    def run_draft(self, token, hidden, P, table_rows) -> torch.Tensor:
        n = token.shape[0]
        B = self.bucket(n)
        self.d_token[:n].copy_(token)
        self.d_hidden[:n].copy_(hidden)
        self.d_pos[:n].copy_(P)
        self.d_rows[:n].copy_(table_rows)
        self.d_rows[n:B].fill_(self.dummy_row)
        self.d_pos[n:B].fill_(1)
        graph, drafts = self.draft_graphs[B]
        graph.replay()
        return drafts[:n]
