"""Reference paged attention: gathers each sequence's visible pages and runs eager attention.

Runs everywhere (it is the CPU path and the oracle for the Triton kernels); it reads the metadata back to
the host and loops over sequences, so it is never used inside CUDA graphs.
"""

from __future__ import annotations

import torch

from gemma4serve.attention.metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Store the new rows' K/V [T, nkv, hd] in their physical slots."""
    nkv, hd = k_cache.shape[-2:]
    k_cache.view(-1, nkv, hd).index_copy_(0, slots, k)
    v_cache.view(-1, nkv, hd).index_copy_(0, slots, v)


class TorchAttention:
    name = "torch"

    @staticmethod
    def write(k_cache, v_cache, k, v, slots):
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
        nh = q.shape[1]
        group = nh // nkv
        window = meta.window[kind]
        table = meta.page_table[kind]
        cu = meta.cu_seqlens_q.tolist()
        kv_end = meta.kv_end.tolist()
        rows = meta.token_seq.tolist()
        out = torch.empty_like(q)
        for g in range(len(cu) - 1):
            r0, r1 = cu[g], cu[g + 1]
            if r0 == r1:
                continue
            ends = kv_end[r0:r1]
            hi = max(ends)
            lo = max(0, min(ends) - window) if window else 0
            pos = torch.arange(lo, hi, device=q.device)
            pages = table[rows[r0], pos // page_size].long()
            flat = pages * page_size + pos % page_size
            keys = k_cache.view(-1, nkv, hd)[flat]  # [S, nkv, hd]
            vals = v_cache.view(-1, nkv, hd)[flat]
            keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [nh, S, hd]
            vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
            qb = q[r0:r1].transpose(0, 1)  # [nh, n, hd]
            scores = qb @ keys.transpose(1, 2)  # scaling 1.0: q_norm/k_norm replace 1/sqrt(d)
            end = torch.tensor(ends, device=q.device)[:, None]
            visible = pos[None, :] < end
            if window:
                visible &= pos[None, :] >= end - window
            scores = scores.masked_fill(~visible[None], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out[r0:r1] = (probs @ vals).transpose(0, 1)
        return out
