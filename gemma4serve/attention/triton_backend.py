"""Triton attention backend: the same `write` / `forward` contract as TorchAttention, on our own
kernels.

No host synchronisation anywhere (grid sizes come from host ints in the metadata), so it can run
inside CUDA graphs; on CPU it runs under TRITON_INTERPRET=1 (tests only: the interpreter is slow).
"""

from __future__ import annotations

import torch

from gemma4serve.attention.metadata import AttentionMetadata
from gemma4serve.config import FULL, TextConfig
from gemma4serve_kernels import attention_config, kv_write, paged_attention


def context_changes_tiles(cfg: TextConfig, tokens: int, max_q_len: int, chunk_context: int) -> bool:
    """Whether a prefill launch of `tokens` rows (its longest group `max_q_len`) whose chunks
    reach `chunk_context` positions takes other full-layer tiles than the same launch without
    them (`attention_config`): a captured launch, which cannot see the context, runs the others."""
    head_dim, kv_heads = cfg.kind_spec(FULL)
    group = cfg.num_heads // kv_heads
    tiles = attention_config(head_dim, group, max_q_len, tokens, kv_heads, chunk_context)
    return tiles != attention_config(head_dim, group, max_q_len, tokens, kv_heads)


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
            chunk_context=meta.chunk_context,
        )
