"""What every attention backend sees: one packed batch of query tokens over the paged KV pools.

Layout (shared by the torch, Triton and FlashInfer backends):
- KV of one layer type lives in `KVCache.k[kind]` / `.v[kind]`, each
  [num_producer_layers_of_kind, num_pages, page_size, num_kv_heads, head_dim]. Physical page 0 of every pool
  is a never-allocated null page: page-table entries that no longer map anything point there.
- A sequence has one page table per kind, indexed by *logical* page = position // page_size over the whole
  sequence. Sliding pages that no reader can reach are freed and their entries reset to 0; kernels only read
  entries inside the visible window.
- Query token t (of sequence `token_seq[t]`) sees the keys at positions [kv_end[t] - window, kv_end[t]) ∩ [0, ∞),
  where window is the kind's visible-key count (0 = unlimited). The target is causal: kv_end = pos + 1 and
  window = W (a query at p sees p-W+1 … p). The drafter reads the committed rows only: kv_end = P and
  window = W_a + 1 (spec §12.2).
- Writes: the K/V of query token t go to slot `write_slot[kind][t]` (= page * page_size + offset) of the
  writing layer, before attention reads; -1 means no write (the drafter never writes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    token_seq: torch.Tensor  # [T] int32: the page-table row of query token t
    kv_end: torch.Tensor  # [T] int32: exclusive end position of the keys token t sees
    page_table: dict  # kind -> [B, max_pages] int32 (logical page -> physical page)
    write_slot: dict  # kind -> [T] int64 physical slot of token t's K/V (unused by readers-only passes)
    window: dict  # kind -> visible keys ending at kv_end (0 = unlimited)
    cu_seqlens_q: torch.Tensor  # [G+1] int32: query rows cu[g]:cu[g+1] are one sequence's consecutive tokens
    max_q_len: int  # host-side bound on the rows of one group (grid sizing)

    @property
    def num_tokens(self) -> int:
        return self.token_seq.shape[0]
