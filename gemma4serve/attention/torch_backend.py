"""Reference paged attention in plain torch: gathers each query token's visible keys and runs eager
attention.

Runs everywhere (it is the CPU path and the oracle for the Triton kernels). It reads one bound back
to the host to size the gather, so it is never used inside CUDA graphs.
"""

from __future__ import annotations

import torch

from gemma4serve.attention.metadata import AttentionMetadata
from gemma4serve.model.layers import write_kv


class TorchAttention:
    name = "torch"

    @staticmethod
    def write(k_cache, v_cache, k, v, slots):
        """Store K/V [T, nkv, hd] at their slots. The model does not call this: its ops write K/V
        (project_qkv)."""
        write_kv(k_cache, v_cache, k, v, slots)

    def forward(
        self,
        q: torch.Tensor,  # [T, nh, hd]
        k_cache: torch.Tensor,  # [num_pages, page_size, nkv, hd]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kind: str,
    ) -> torch.Tensor:
        page_size, nkv, hd = k_cache.shape[1:]
        T, nh = q.shape[:2]
        window = meta.window[kind]
        end = meta.kv_end.long()
        lo = (end - window).clamp(min=0) if window else torch.zeros_like(end)
        span = int((end - lo).max())
        pos = lo[:, None] + torch.arange(span, device=q.device)  # [T, S] key positions per query
        visible = pos < end[:, None]
        pos = torch.where(visible, pos, lo[:, None])  # keep the gather in bounds
        pages = meta.page_table[kind][meta.token_seq.long()[:, None], pos // page_size].long()
        keys = k_cache[pages, pos % page_size]  # [T, S, nkv, hd]
        vals = v_cache[pages, pos % page_size]
        qg = q.view(T, nkv, nh // nkv, hd)  # GQA: query head j reads KV head j // group
        # scaling 1.0: q_norm/k_norm replace 1/sqrt(d)
        scores = torch.einsum("tkgd,tskd->tkgs", qg, keys)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("tkgs,tskd->tkgd", probs, vals)
        return out.reshape(T, nh, hd)
