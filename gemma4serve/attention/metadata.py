"""What every attention backend sees: one packed batch of query tokens over the paged KV pools.

Layout (shared by the torch and Triton backends):
- A layer's K and V are views [num_pages, page_tokens[kind], num_kv_heads, head_dim] into one
  arena of equal-byte pages (`KVCache`), with a page stride of a whole page. Physical page 0 is
  a never-allocated null page: page-table entries that map nothing point there.
- A sequence has one page table per kind, indexed by *logical* page = position //
  page_tokens[kind] over the whole sequence. Sliding pages that no reader can reach are freed
  and their entries reset to 0; kernels only read entries inside the visible window.
- Query token t (of sequence `token_seq[t]`) sees the keys at positions
  [kv_end[t] - window, kv_end[t]) ∩ [0, ∞), where window is the kind's visible-key count
  (0 = unlimited). The target is causal: kv_end = pos + 1 and window = W (a query at p sees
  p-W+1 … p). The drafter reads the committed rows only: kv_end = P and window = W_a + 1
  (docs/gemma4.md §12.2).
- Writes: the K/V of query token t go to slot `write_slot[kind][t]` (= page * page_tokens[kind]
  + offset) of the writing layer, before attention reads; -1 means no write (the drafter never
  writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gemma4serve.config import FULL, SLIDING
from gemma4serve.model import fused


@dataclass
class HostBatch:
    """Host copies of an eager step's layout, for a backend that plans on the host (FlashInfer):
    the query rows of each group, the keys its last query sees (its last position + 1), and the
    page tables per kind."""

    cu_seqlens_q: torch.Tensor  # [G+1] int32
    kv_len: torch.Tensor  # [G] int32
    page_table: dict  # kind -> [G, max_pages] int32


@dataclass
class AttentionMetadata:
    token_seq: torch.Tensor  # [T] int32: the page-table row of query token t
    kv_end: torch.Tensor  # [T] int32: exclusive end position of the keys token t sees
    page_table: dict  # kind -> [B, max_pages] int32 (logical page -> physical page)
    write_slot: (
        dict  # kind -> [T] int64 physical slot of token t's K/V (unused by readers-only passes)
    )
    window: dict  # kind -> visible keys ending at kv_end (0 = unlimited)
    cu_seqlens_q: (
        torch.Tensor
    )  # [G+1] int32: query rows cu[g]:cu[g+1] are one sequence's consecutive tokens
    max_q_len: int  # host-side bound on the rows of one group (grid sizing)
    host: HostBatch | None = None  # eager target steps only (graphed and drafter steps have none)
    # host-side: the most positions any prefill chunk reaches (0 where unknown: captured steps)
    chunk_context: int = 0

    @property
    def num_tokens(self) -> int:
        return self.token_seq.shape[0]


@dataclass
class Readout:
    """The rows of a pass whose final hidden states are read (sampled, or scoring the prompt).
    Past the last K/V write the model runs on these rows only: no other row's output is ever read
    (docs/gemma4.md §3.6)."""

    rows: torch.Tensor  # [R] int64, ascending; a padding entry is T (no row: its result is dropped)
    cu_seqlens_q: torch.Tensor  # [G+1] int32: each group's read-out rows; padding in no group
    max_q_len: int  # host-side bound on one group's read-out rows

    def metadata(self, meta: AttentionMetadata, rows: torch.Tensor) -> AttentionMetadata:
        """`meta` restricted to the read-out rows (`rows`: their indices with padding clamped into
        the pass), for attention that writes no K/V."""
        return AttentionMetadata(
            token_seq=meta.token_seq[rows],
            kv_end=meta.kv_end[rows],
            page_table=meta.page_table,
            write_slot={},
            window=meta.window,
            cu_seqlens_q=self.cu_seqlens_q,
            max_q_len=self.max_q_len,
        )


def readout_layout(group_starts: list[int], counts: list[int]) -> tuple[list[int], list[int]]:
    """(rows, group starts among them) of the last `counts[g]` rows of each group g of a packed
    pass whose groups start at `group_starts` [G+1] (host lists: at most a few hundred groups)."""
    rows, starts = [], [0]
    for end, count in zip(group_starts[1:], counts):
        rows += range(end - count, end)
        starts.append(len(rows))
    return rows, starts


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without waiting: a copy from pageable memory first drains the stream, which
    would stall the host while an earlier step still runs; from pinned memory it is queued like a
    kernel."""
    if t.device == device or device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, queued without waiting when `src` is on the host (see `to_device`)."""
    if src.device.type == "cpu" and dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


def page_tables(pages: list) -> dict:
    """Host-side page tables of a step's sequences (a row each, 0 = null page), per pool kind.
    Filled through numpy: a list row converts there in one C loop (torch.tensor of nested lists is
    ~4x slower, and a table grows with the context)."""
    out = {}
    for kind, attr in ((FULL, "full"), (SLIDING, "sliding")):
        rows = [getattr(p, attr) for p in pages]
        table = np.zeros((len(rows), max(1, max(len(r) for r in rows))), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        out[kind] = torch.from_numpy(table)
    return out


def causal_metadata(
    token_seq: torch.Tensor,
    pos: torch.Tensor,
    tables: dict,
    window: dict,
    cu_seqlens_q: torch.Tensor,
    max_q_len: int,
    page_tokens: dict[str, int],
    host: HostBatch | None = None,
    chunk_context: int = 0,
) -> AttentionMetadata:
    """Metadata of a target pass, derived on the device: each token sees keys up to its own
    position and writes its K/V to the slot its page table maps its position to
    (page * page_tokens[kind] + offset)."""
    kernels = fused.on(pos)
    if (
        kernels is not None
        and len(tables) == 2
        and token_seq.is_contiguous()
        and pos.is_contiguous()
    ):
        kv_end, write_slot = kernels.write_slots(token_seq, pos, tables, page_tokens)  # one launch
    else:
        rows = token_seq.long()
        kv_end = (pos + 1).to(torch.int32)
        write_slot = {
            kind: t[rows, pos // page_tokens[kind]].long() * page_tokens[kind]
            + pos % page_tokens[kind]
            for kind, t in tables.items()
        }
    return AttentionMetadata(
        token_seq=token_seq,
        kv_end=kv_end,
        page_table=tables,
        write_slot=write_slot,
        window=window,
        cu_seqlens_q=cu_seqlens_q,
        max_q_len=max_q_len,
        host=host,
        chunk_context=chunk_context,
    )
