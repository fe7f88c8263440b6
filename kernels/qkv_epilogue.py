"""Everything between the fused qkv projection and attention, in one launch (docs/gemma4.md §3.5).

q = RoPE(q_norm(q)), k = RoPE(k_norm(k)), v = v_norm(v) (v is the raw k on k_eq_v layers), and the
new K/V stored in their cache slots. The rounding points are the torch ops' (and norm.py's
kernels'), so the result equals norm_rope, rms_norm and kv_write run one after another.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import pdl_args, round_to, wait_for_producer


@triton.jit
def _normed(row_ptr, w, d, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm of one head's row at dims d (fp32, before rounding), times w (w[d], or 1.0 for no
    scale)."""
    x = tl.load(row_ptr + tl.arange(0, HEAD_DIM)).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    return tl.load(row_ptr + d).to(tl.float32) * inv * w


@triton.jit
def _norm_rope_row(
    row_ptr, w, w_rot, d, d_rot, c, s, eps, HEAD_DIM: tl.constexpr, DT: tl.constexpr
):
    """RoPE(RMSNorm(row) * w): dim d pairs with d_rot = d + hd/2 (mod hd) in the half-split
    rotation."""
    HALF: tl.constexpr = HEAD_DIM // 2
    y = round_to(_normed(row_ptr, w, d, eps, HEAD_DIM), DT)
    y_rot = round_to(
        tl.where(d < HALF, -1.0, 1.0) * _normed(row_ptr, w_rot, d_rot, eps, HEAD_DIM), DT
    )
    return round_to(round_to(y * c, DT) + round_to(y_rot * s, DT), DT)


@triton.jit
def _qkv_epilogue_kernel(
    x_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_xt,
    stride_ct,
    stride_st,
    stride_qt,
    stride_cpage,
    stride_cslot,
    eps,
    PAGE: tl.constexpr,
    NH: tl.constexpr,
    NKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_EQ_V: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    d_rot = (d + HEAD_DIM // 2) % HEAD_DIM
    DT: tl.constexpr = q_ptr.dtype.element_ty
    # Before waiting on the qkv projection: what was written before the step (norm weights, the
    # step's cos/sin and cache slots).
    w_ptr = tl.where(h < NH, qw_ptr, kw_ptr)
    w = tl.load(w_ptr + d).to(tl.float32)
    w_rot = tl.load(w_ptr + d_rot).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    wait_for_producer(PDL)
    row = x_ptr + t * stride_xt
    if h < NH:  # a query head
        q = _norm_rope_row(row + h * HEAD_DIM, w, w_rot, d, d_rot, c, s, eps, HEAD_DIM, DT)
        tl.store(q_ptr + t * stride_qt + h * HEAD_DIM + d, q.to(DT))
    else:  # a KV head: K and V, written straight into the cache
        kh = h - NH
        k_row = row + (NH + kh) * HEAD_DIM
        k = _norm_rope_row(k_row, w, w_rot, d, d_rot, c, s, eps, HEAD_DIM, DT)
        v_row = k_row if K_EQ_V else row + (NH + NKV + kh) * HEAD_DIM
        v = round_to(_normed(v_row, 1.0, d, eps, HEAD_DIM), DT)
        if slot >= 0:
            dst = (slot // PAGE) * stride_cpage + (slot % PAGE) * stride_cslot + kh * HEAD_DIM + d
            tl.store(kc_ptr + dst, k.to(DT))
            tl.store(vc_ptr + dst, v.to(DT))


def qkv_epilogue(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_eq_v: bool,
) -> torch.Tensor:
    """qkv [T, (nh + nkv (+ nkv)) * hd] (q, k, then v unless k_eq_v) -> q [T, nh, hd].

    K/V go to the caches [num_pages, page_tokens, nkv, hd] (pages at any stride) at `slots` [T]
    (-1 = no write).
    """
    T = qkv.shape[0]
    hd = k_cache.shape[-1]
    assert (
        hd & (hd - 1) == 0 and qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    )
    assert k_cache.stride() == v_cache.stride() and k_cache.shape[-2] == num_kv_heads
    assert (
        k_cache.stride(-1) == 1
        and k_cache.stride(-2) == hd
        and k_cache.stride(1) == num_kv_heads * hd
    )
    q = torch.empty(T, num_heads, hd, dtype=qkv.dtype, device=qkv.device)
    if T:
        _qkv_epilogue_kernel[(T, num_heads + num_kv_heads)](
            qkv,
            q_weight,
            k_weight,
            cos,
            sin,
            q,
            k_cache,
            v_cache,
            slots,
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            q.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            eps,
            PAGE=k_cache.shape[1],
            NH=num_heads,
            NKV=num_kv_heads,
            HEAD_DIM=hd,
            K_EQ_V=k_eq_v,
            num_warps=4 if hd <= 256 else 8,
            **pdl_args(qkv.device),
        )
    return q
