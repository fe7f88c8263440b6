"""Triton attention backend: the same `write` / `forward` contract as TorchAttention, on our own
kernels.

No host synchronisation anywhere (grid sizes come from host ints in the metadata), so it can run
inside CUDA graphs; on CPU it runs under TRITON_INTERPRET=1 (tests only: the interpreter is slow).
"""

from __future__ import annotations

import torch

from gemma4serve.attention.metadata import AttentionMetadata
from gemma4serve_kernels import kv_write, paged_attention


class TritonAttention:
    name = "triton"

    @staticmethod
    def write(k_cache, v_cache, k, v, slots):
        """Store K/V [T, nkv, hd] at their slots (slot -1 = no write), one launch for both caches.
        The model does not call this: its ops write K/V (project_qkv)."""
        kv_write(k_cache, v_cache, k, v, slots)

    def forward(
        self,
        q: torch.Tensor,  # [T, nh, hd]
        k_cache: torch.Tensor,  # [num_pages, page_size, nkv, hd]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kind: str,
    ) -> torch.Tensor:
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.token_seq,
            meta.kv_end,
            meta.page_table[kind],
            meta.cu_seqlens_q,
            meta.max_q_len,
            meta.window[kind],
        )
