"""CUDA graphs for the steady state: the target's decode/verify forward (with the logits of every
row) and the whole draft loop, each captured once per batch-size bucket and per draft length the
engine may choose (`spec.draft_choices`: k and half of it). Where the target has a greedy head,
every bucket also gets a greedy variant of the forward that ends in each row's greedy token instead
of the logits (the greedy head's, or the first maximum of the softcapped logits in one read past
its rows).

A decode step of B sequences with d drafts each is B groups of Q = d + 1 query tokens. Its token
ids, positions and page tables are copied into static buffers; write slots and key ranges are
derived inside the graph. Rows past B point at a dummy page-table row of null pages at position
0, so they write into the null page. The graph for the smallest bucket >= B is replayed and the
first B*Q rows of the outputs are the step's.

Steps that carry prefill chunks (or uneven draft counts) replay a mixed graph, captured per bucket
of tokens and of sequences: their rows are packed as in an eager step and padded to the bucket with
one group of null-page rows at position 0; the attention grid covers the bucket's rows in every
group, and groups past the step's own are empty. What follows the last K/V write runs on the
step's read-out rows only (`Readout`), padded to the most a bucket's groups can read. Eagerly,
launching such a step cost the host more time than the GPU's work for the smaller models. Their
draft loop replays the decode graphs' one.

All graphs share one memory pool, so a graph's outputs are only valid until the next replay of
any graph: read or copy them first.
"""

from __future__ import annotations

import logging
import time

import torch

from gemma4serve.attention.metadata import (
    Readout,
    causal_metadata,
    copy_into,
    readout_layout,
    to_device,
)
from gemma4serve.attention.triton_backend import context_changes_tiles
from gemma4serve.config import FULL, SLIDING, TextConfig
from gemma4serve.engine.spec import DraftLoop, StepCost, draft_choices
from gemma4serve.model.gemma4 import ForwardContext

log = logging.getLogger("gemma4serve")

# A step whose chunks' context changes its attention tiles runs eagerly only where its layers'
# matmuls outlast the host's eager launch (30-60 ms, H200): from this much work, the 31B's 1024
# rows; the E models' 2048-row steps ran 6-36% slower eagerly (docs/performance.md).
EAGER_STEP_FLOPS = 40e12


def matmul_flops_per_row(model: torch.nn.Module) -> float:
    """FLOPs of the matrices one row multiplies in the decoder layers (an MoE layer's experts by
    the share of them a row routes to)."""
    cfg, total = model.cfg, 0.0
    for name, param in model.named_parameters():
        if name.startswith("layers.") and param.dim() >= 2:
            share = cfg.top_k_experts / cfg.num_experts if ".experts." in name else 1.0
            total += 2 * param.numel() * share
    return total


def leaves_graph_for_context(
    cfg: TextConfig, flops_per_row: float, tokens: int, max_q_len: int, chunk_context: int
) -> bool:
    """Whether a packed step of `tokens` rows (its longest group `max_q_len`) whose chunks reach
    `chunk_context` positions runs eagerly: that context changes its attention tiles (which a
    captured launch cannot see), and its matmuls (`flops_per_row` a row) outlast the host's eager
    launch."""
    return tokens * flops_per_row >= EAGER_STEP_FLOPS and context_changes_tiles(
        cfg, tokens, max_q_len, chunk_context
    )


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [b for b in sizes if b < max_batch] + [max_batch]


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Rows of the mixed graphs: 64, then multiples of 128 up to the budget. A padded row costs
    the GEMM compute of a prompt row, so a lone 1024-token prompt beside 32 three-row
    verifications (1120 rows) should pad to 1152, not 1280."""
    sizes = [64] + list(range(128, max_tokens, 128))
    return [t for t in sizes if t < max_tokens] + [max_tokens]


def mixed_group_buckets(max_batch: int) -> list[int]:
    """Sequences of the mixed graphs: coarse, as every group adds programs to the attention grid."""
    return [g for g in (4, 16, 64) if g < max_batch] + [max_batch]


def capture_graphs(state, args, k: int) -> tuple[CudaGraphs | None, dict[int, StepCost] | None]:
    """The decode/verify, mixed and draft-loop graphs of one rank (CUDA, Triton attention), and
    each bucket's measured step costs for the adaptive draft length. Under tensor parallelism every
    rank calls this at the same point with the same arguments: the graphs hold the all-reduces, so
    every rank captures, measures and replays the same graphs in the same order."""
    if state.device.type != "cuda" or args.enforce_eager or state.attn.name == "torch":
        return None, None
    graphs = CudaGraphs(
        state, args.max_num_seqs, state.kv_plan.max_model_len, k, args.max_num_batched_tokens
    )
    graphs.capture()
    costs = graphs.measure() if args.adaptive_draft_length else None
    if costs:
        log.info(
            "step costs per batch bucket (ms: decode, then verify + draft loop per draft length "
            "d): %s",
            "; ".join(
                f"{b}: {c.decode * 1e3:.2f}"
                + "".join(
                    f", d={d} {c.verify[d] * 1e3:.2f} + {c.draft[d] * 1e3:.2f}" for d in c.verify
                )
                for b, c in costs.items()
            ),
        )
    return graphs, costs


class CudaGraphs:
    def __init__(
        self,
        state,
        max_batch: int,
        max_model_len: int,
        num_draft_tokens: int,
        max_mixed_tokens: int = 0,
    ):
        self.state = state
        self.buckets = batch_buckets(max_batch)
        self.draft_lengths = draft_choices(num_draft_tokens) if state.draft is not None else []
        self.q_lens = [1] + [d + 1 for d in self.draft_lengths]
        # No mixed graphs (max_mixed_tokens 0): the decode benchmarks capture decode steps only.
        self.mixed_tokens = mixed_token_buckets(max_mixed_tokens) if max_mixed_tokens else []
        self.mixed_groups = mixed_group_buckets(max_batch) if max_mixed_tokens else []
        self.flops_per_row = matmul_flops_per_row(state.target)
        B = self.buckets[-1]
        T = max(B * max(self.q_lens), max_mixed_tokens)
        dev, page_tokens = state.device, state.kv.page_tokens
        # Page-table columns: a step queued behind another writes up to 2(k+1) rows past a
        # sequence's end.
        rows = max_model_len + 2 * (num_draft_tokens + 1)
        self.width = {kind: -(-rows // n) + 1 for kind, n in page_tokens.items()}
        self.dummy_row = B  # a page-table row of null pages for padding
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self.ids = torch.zeros(T, **i64)
        self.pos = torch.zeros(T, **i64)
        self.token_seq = torch.full((T,), B, **i32)
        self.tables = {kind: torch.zeros(B + 1, n, **i32) for kind, n in self.width.items()}
        # What run_target last wrote into token_seq and the tables: an unchanged input is not copied
        # again (at batch 1 each copy is a launch between two steps, and a page table changes once
        # per page of tokens).
        self._token_seq_key: tuple | None = None
        self._copied_tables: dict = {}
        # Built once and kept: a tensor a graph reads must outlive the capture (its memory is not
        # the graph's).
        self.cu_seqlens = {q: torch.arange(0, B * q + 1, q, **i32) for q in self.q_lens}
        # A mixed step's group starts: its own groups, one of padding rows, then empty ones.
        self.mixed_cu_seqlens = torch.zeros(B + 2, **i32)
        # Its read-out rows, which the layers past the last K/V write run on alone: at most
        # max(q_lens) a group (else the step runs eagerly), padded with the bucket's T, and their
        # group starts (padding rows in no group).
        self.readout_max_q_len = max(self.q_lens)
        self.readout_rows = torch.zeros(T, **i64)
        self.readout_cu_seqlens = torch.zeros(B + 1, **i32)
        H = state.target.cfg.hidden_size
        self.d_token = torch.zeros(B, **i64)
        self.d_hidden = torch.zeros(B, H, dtype=state.dtype, device=dev)
        self.d_pos = torch.ones(B, **i64)
        self.d_rows = torch.full((B,), B, **i32)
        # One logits output for every decode/verify graph (they never run at once): a graph's own
        # [B x Q, V] would stay alive with it, gigabytes over the buckets of a 262k vocabulary.
        V = state.target.cfg.vocab_size
        self.logits = torch.empty(B * max(self.q_lens), V, dtype=state.dtype, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.target_graphs: dict = {}  # (B, Q, greedy) -> (graph, hidden, logits or greedy tokens)
        self.mixed_graphs: dict = {}  # (tokens, groups) -> (graph, hidden)
        self.draft_graphs: dict = {}  # (B, draft length) -> (graph, drafts)
        self.draft_loop = (
            DraftLoop(state) if (state.draft is not None and num_draft_tokens) else None
        )

    # ---- capture --------------------------------------------------------------------------------

    def _target_fn(self, B: int, Q: int, greedy: bool):
        state, T = self.state, B * Q

        def run():
            meta = causal_metadata(
                self.token_seq[:T],
                self.pos[:T],
                self.tables,
                {SLIDING: state.target.cfg.sliding_window, FULL: 0},
                self.cu_seqlens[Q][: B + 1],
                Q,
                state.kv.page_tokens,
            )
            context = ForwardContext(meta, state.kv, state.attn)
            hidden = state.target(self.ids[:T], self.pos[:T], context)
            if greedy:
                return hidden, state.target.greedy(hidden)
            return hidden, state.target.logits(hidden, out=self.logits[:T])

        return run

    def _mixed_readout_rows(self, T: int, G: int) -> int:
        return min(T, G * self.readout_max_q_len)

    def _mixed_fn(self, T: int, G: int):
        state = self.state
        readout = Readout(
            self.readout_rows[: self._mixed_readout_rows(T, G)],
            self.readout_cu_seqlens[: G + 1],
            self.readout_max_q_len,
        )

        def run():
            meta = causal_metadata(
                self.token_seq[:T],
                self.pos[:T],
                self.tables,
                {SLIDING: state.target.cfg.sliding_window, FULL: 0},
                self.mixed_cu_seqlens[: G + 2],
                T,
                state.kv.page_tokens,
            )
            return state.target(
                self.ids[:T], self.pos[:T], ForwardContext(meta, state.kv, state.attn, readout)
            )

        return run

    def _draft_fn(self, B: int, draft_len: int):
        def run():
            return self.draft_loop.run(
                self.d_token[:B],
                self.d_hidden[:B],
                self.d_pos[:B],
                self.d_rows[:B],
                self.tables,
                draft_len,
            )

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
        reserved = torch.cuda.memory_reserved(self.state.device)
        # Largest first, so smaller graphs reuse its memory pool. Captured with every group empty.
        for T in reversed(self.mixed_tokens):
            for G in reversed(self.mixed_groups):
                self.mixed_graphs[(T, G)] = self._capture(self._mixed_fn(T, G))
        variants = (False, True) if self.state.target.greedy_head is not None else (False,)
        for B in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory pool
            for Q in self.q_lens:
                for greedy in variants:
                    graph, (hidden, out) = self._capture(self._target_fn(B, Q, greedy))
                    self.target_graphs[(B, Q, greedy)] = (graph, hidden, out)
            if self.draft_loop is not None:
                for d in self.draft_lengths:
                    self.draft_graphs[(B, d)] = self._capture(self._draft_fn(B, d))
        torch.cuda.synchronize()
        log.info(
            "captured %d CUDA graphs (batch buckets %s; mixed steps: token buckets %s x sequence "
            "buckets %s) in %.1fs, holding %.2f GiB more",
            len(self.target_graphs) + len(self.draft_graphs) + len(self.mixed_graphs),
            self.buckets,
            self.mixed_tokens,
            self.mixed_groups,
            time.monotonic() - t0,
            (torch.cuda.memory_reserved(self.state.device) - reserved) / 2**30,
        )

    @torch.inference_mode()
    def measure(self) -> dict[int, StepCost]:
        """Each bucket's decode replay time, and its verify and draft-loop replay times per draft
        length, for choosing the draft length. The static inputs still point every row at the null
        page, so this is the weights' and launches' cost; the KV reads of real contexts come on top
        of decode and verify alike."""
        if self.draft_loop is None:
            return {}
        lengths = self.draft_lengths
        return {
            B: StepCost(
                decode=self._time(self.target_graphs[(B, 1, False)][0]),
                verify={d: self._time(self.target_graphs[(B, d + 1, False)][0]) for d in lengths},
                draft={d: self._time(self.draft_graphs[(B, d)][0]) for d in lengths},
            )
            for B in self.buckets
        }

    @staticmethod
    def _time(graph, reps: int = 3) -> float:
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps / 1e3

    # ---- replay ---------------------------------------------------------------------------------

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, n: int, Q: int, tables: dict) -> bool:
        """Whether n sequences of Q query rows each, with these host page tables, have a graph."""
        wide = any(t.shape[1] >= self.width[kind] for kind, t in tables.items())
        return Q in self.q_lens and self.bucket(n) is not None and not wide

    def leaves_for_context(self, batch) -> bool:
        """Whether a packed step runs eagerly on the tiles its chunks' context picks
        (`leaves_graph_for_context`)."""
        if not batch.chunk_context:
            return False
        T, longest = batch.token_ids.shape[0], int(batch.group_starts.diff().max())
        cfg = self.state.target.cfg
        return leaves_graph_for_context(cfg, self.flops_per_row, T, longest, batch.chunk_context)

    def fits_mixed(self, batch) -> bool:
        """Whether a packed step (a TargetBatch packed on the host) has a mixed graph: its rows,
        sequences, page tables and read-out rows a group; and not a step that runs eagerly for
        its chunks' context (`leaves_for_context`)."""
        T = batch.token_ids.shape[0]
        return (
            bool(self.mixed_tokens)
            and T <= self.mixed_tokens[-1]
            and not self.leaves_for_context(batch)
            and batch.num_groups <= self.mixed_groups[-1]
            and all(t.shape[1] < self.width[kind] for kind, t in batch.page_tables.items())
            and int(batch.readout_counts().max()) <= self.readout_max_q_len
        )

    def run_mixed(self, batch) -> torch.Tensor:
        """Replay the mixed graph of the smallest buckets that hold `batch` (a TargetBatch packed on
        the host) -> hidden [T, H]."""
        T, G = batch.token_ids.shape[0], batch.num_groups
        T_bucket = next(t for t in self.mixed_tokens if t >= T)
        G_bucket = next(g for g in self.mixed_groups if g >= G)
        dev = self.state.device
        copy_into(self.ids[:T], batch.token_ids)
        copy_into(self.pos[:T], batch.positions)
        self.pos[T:T_bucket].zero_()
        group_starts = batch.group_starts.tolist()
        copy_into(
            self.mixed_cu_seqlens[: G_bucket + 2],
            torch.tensor(group_starts + [T_bucket] * (G_bucket + 1 - G), dtype=torch.int32),
        )
        rows, starts = readout_layout(group_starts, batch.readout_counts().tolist())
        R = self._mixed_readout_rows(T_bucket, G_bucket)
        copy_into(
            self.readout_rows[:R],
            torch.tensor(rows + [T_bucket] * (R - len(rows)), dtype=torch.int64),
        )
        copy_into(
            self.readout_cu_seqlens[: G_bucket + 1],
            torch.tensor(starts + [len(rows)] * (G_bucket - G), dtype=torch.int32),
        )
        token_group = torch.repeat_interleave(
            torch.arange(G, device=dev, dtype=torch.int32),
            to_device(batch.group_starts.diff(), dev),
            output_size=T,
        )
        self.token_seq[:T].copy_(token_group)
        self.token_seq[T:T_bucket].fill_(self.dummy_row)
        self._token_seq_key = None  # the decode graphs' map must be rebuilt
        for kind, host in batch.page_tables.items():
            copy_into(self.tables[kind][:G, : host.shape[1]], host)
            self._copied_tables[kind] = host
        graph, hidden = self.mixed_graphs[(T_bucket, G_bucket)]
        graph.replay()
        return hidden[:T]

    def run_target(
        self, ids: torch.Tensor, pos: torch.Tensor, Q: int, tables: dict, greedy: bool = False
    ):
        """Replay the decode/verify graph: ids and positions [n*Q] (host or device), host page
        tables [n, w] per kind -> (hidden [n*Q, H], logits [n*Q, V] or None, greedy tokens [n*Q]
        or None). `greedy`: only the argmax of each row is needed, so the bucket's greedy variant
        runs where it has one."""
        T = ids.shape[0]
        n = T // Q
        B = self.bucket(n)
        dev = self.state.device
        copy_into(self.ids[:T], ids)
        copy_into(self.pos[:T], pos)
        self.pos[T : B * Q].zero_()
        if self._token_seq_key != (T, Q, B):
            torch.div(
                torch.arange(T, device=dev, dtype=torch.int32),
                Q,
                rounding_mode="floor",
                out=self.token_seq[:T],
            )
            self.token_seq[T : B * Q].fill_(self.dummy_row)
            self._token_seq_key = (T, Q, B)
        for kind, host in tables.items():
            last = self._copied_tables.get(kind)
            if last is None or not torch.equal(last, host):  # (False for another shape too)
                copy_into(self.tables[kind][:n, : host.shape[1]], host)
                self._copied_tables[kind] = host
        greedy = greedy and (B, Q, True) in self.target_graphs
        graph, hidden, out = self.target_graphs[(B, Q, greedy)]
        graph.replay()
        return (hidden[:T], None, out[:T]) if greedy else (hidden[:T], out[:T], None)

    def fits_draft(self, n: int, draft_len: int, tables: dict | None = None) -> bool:
        """Whether the draft loop of n sequences proposing draft_len drafts has a graph, over a
        replayed target step's tables or an eager step's device page `tables` (copied into the
        graph's own)."""
        return (
            draft_len in self.draft_lengths
            and self.bucket(n) is not None
            and all(
                t.shape[0] <= self.dummy_row and t.shape[1] <= self.width[kind]
                for kind, t in (tables or {}).items()
            )
        )

    def run_draft(
        self, token, hidden, P, table_rows, draft_len: int, tables: dict | None = None
    ) -> torch.Tensor:
        """Replay the draft-loop graph. `tables`: an eager step's device page tables, copied in
        first (a replayed target step left its own there)."""
        if tables is not None:
            for kind, table in tables.items():
                self.tables[kind][: table.shape[0], : table.shape[1]].copy_(table)
            self._copied_tables.clear()  # the next target replay copies its tables again
        n = token.shape[0]
        B = self.bucket(n)
        self.d_token[:n].copy_(token)
        self.d_hidden[:n].copy_(hidden)
        self.d_pos[:n].copy_(P)
        self.d_rows[:n].copy_(table_rows)
        self.d_rows[n:B].fill_(self.dummy_row)
        self.d_pos[n:B].fill_(1)
        graph, drafts = self.draft_graphs[(B, draft_len)]
        graph.replay()
        return drafts[:n]
