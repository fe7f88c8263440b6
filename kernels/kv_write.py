"""Store the new tokens' K and V rows into their paged slots: one launch for both caches.

torch's `index_copy_` is graph-safe too, but it costs two launches per layer (K and V) and cannot
express "slot -1 = no write" (the layout's marker for rows that only read). Here one program copies
one token's [nkv, hd] K and V rows; a negative slot is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    PAGE: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    in_page = slot % PAGE
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < num_kv_heads)[:, None]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(
        kc_ptr + page * stride_kcp + in_page * stride_kcs + h[:, None] * stride_kch + d[None, :],
        k,
        mask=mask,
    )
    tl.store(
        vc_ptr + page * stride_vcp + in_page * stride_vcs + h[:, None] * stride_vch + d[None, :],
        v,
        mask=mask,
    )


def kv_write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
):
    """k_cache/v_cache [num_pages, page_size, nkv, hd]; k/v [T, nkv, hd];
    slots [T] = page * page_size + offset, -1 = skip."""
    T, nkv, hd = k.shape
    if T == 0:
        return
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype, (
        "K/V must already be in the cache dtype"
    )
    assert hd & (hd - 1) == 0 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _kv_write_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        nkv,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        PAGE=k_cache.shape[1],
        HEADS_P=next_pow2(nkv),
        HEAD_DIM=hd,
        num_warps=4,
    )
