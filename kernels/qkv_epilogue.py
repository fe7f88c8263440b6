"""Everything between the fused qkv projection and attention, in one launch (docs/gemma4.md §3.5).

q = RoPE(q_norm(q)), k = RoPE(k_norm(k)), v = v_norm(v) (v is the raw k on k_eq_v layers), and the
new K/V stored in their cache slots. The rounding points are the torch ops' (and norm.py's
kernels'), so the result equals norm_rope, rms_norm and kv_write run one after another.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import pdl_args, round_to, wait_for_producer

PREFILL_TOKENS = 256  # steps with at least this many tokens take several query heads per program


@triton.jit
def _norm_rope_row(
    row_ptr, w, w_rot, d, d_rot, c, s, eps, HEAD_DIM: tl.constexpr, DT: tl.constexpr
):
    """RoPE(RMSNorm(row) * w): dim d pairs with d_rot = d + hd/2 (mod hd) in the half-split
    rotation."""
    HALF: tl.constexpr = HEAD_DIM // 2
    x = tl.load(row_ptr + d).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    x_rot = tl.load(row_ptr + d_rot).to(tl.float32)  # the same row, rotated (an L1 hit)
    y = round_to(x * inv * w, DT)
    y_rot = round_to(tl.where(d < HALF, -1.0, 1.0) * (x_rot * inv * w_rot), DT)
    return round_to(round_to(y * c, DT) + round_to(y_rot * s, DT), DT)


@triton.jit
def _norm_row(row_ptr, d, eps, HEAD_DIM: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of one head's row without a scale, rounded to DT."""
    x = tl.load(row_ptr + d).to(tl.float32)
    return round_to(x * tl.math.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps), DT)


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
    HEADS: tl.constexpr,
    K_EQ_V: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # Programs [0, NH / HEADS) own HEADS query heads each; the next NKV one KV head each.
    block = tl.program_id(1)
    is_query = block < NH // HEADS
    d = tl.arange(0, HEAD_DIM)
    d_rot = (d + HEAD_DIM // 2) % HEAD_DIM
    DT: tl.constexpr = q_ptr.dtype.element_ty
    # Before waiting on the qkv projection: what was written before the step (norm weights, the
    # step's cos/sin and cache slots).
    w_ptr = tl.where(is_query, qw_ptr, kw_ptr)
    w = tl.load(w_ptr + d).to(tl.float32)
    w_rot = tl.load(w_ptr + d_rot).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    wait_for_producer(PDL)
    row = x_ptr + t * stride_xt
    if is_query:
        for i in tl.static_range(HEADS):
            h = block * HEADS + i
            q = _norm_rope_row(row + h * HEAD_DIM, w, w_rot, d, d_rot, c, s, eps, HEAD_DIM, DT)
            tl.store(q_ptr + t * stride_qt + h * HEAD_DIM + d, q.to(DT))
    else:  # a KV head: K and V, written straight into the cache
        kh = block - NH // HEADS
        k_row = row + (NH + kh) * HEAD_DIM
        k = _norm_rope_row(k_row, w, w_rot, d, d_rot, c, s, eps, HEAD_DIM, DT)
        v_row = k_row if K_EQ_V else row + (NH + NKV + kh) * HEAD_DIM
        v = _norm_row(v_row, d, eps, HEAD_DIM, DT)
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
    heads_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """qkv [T, (nh + nkv (+ nkv)) * hd] (q, k, then v unless k_eq_v) -> q [T, nh, hd].

    K/V go to the caches [num_pages, page_tokens, nkv, hd] (pages at any stride) at `slots` [T]
    (-1 = no write). `heads_per_program` (query heads, a divisor of nh) and `num_warps` override the
    choices below (benchmarks, tests).
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
    # Prefill chunks: several query heads per program, so the per-program setup (weights, cos/sin,
    # the wait) is paid once per token rather than per head; decode grids stay one head wide.
    heads = heads_per_program or (math.gcd(num_heads, 8) if T >= PREFILL_TOKENS else 1)
    assert num_heads % heads == 0
    if T:
        _qkv_epilogue_kernel[(T, num_heads // heads + num_kv_heads)](
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
            HEADS=heads,
            K_EQ_V=k_eq_v,
            # one warp keeps each head's sum of squares in warp shuffles (no barrier); with one head
            # per program (decode) more warps finish the lone head sooner
            num_warps=num_warps or (1 if heads > 1 else (4 if hd <= 256 else 8)),
            **pdl_args(qkv.device),
        )
    return q
