"""Fused Gemma 4 RMSNorms: fp32 inside, x * (mean(x²) + eps)^-0.5, times w (not 1 + w).

The norms of docs/gemma4.md §2, §3.4–3.5. Each kernel keeps the rounding points of the torch
reference (`gemma4serve/model/layers.py`): the normed value is rounded to the model dtype before it
is added, rotated or scaled, exactly where the bf16 tensor ops round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, pdl_args, round_to, row_warps, wait_for_producer


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    o_ptr,
    n,
    inner,
    stride_x0,
    stride_x1,
    stride_o,
    eps,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    # Row r of the output is x[r // inner, r % inner, :]: per-head views of a fused projection
    # output ([T, heads, hd] with a wide token stride) are normed in place of a copy.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x_row = x_ptr + (row // inner) * stride_x0 + (row % inner) * stride_x1
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    DT: tl.constexpr = o_ptr.dtype.element_ty
    tl.store(o_ptr + row * stride_o + offs, round_to(y, DT).to(DT), mask=mask)


@triton.jit
def _residual_norm_kernel(
    x_ptr,
    h_ptr,
    w_ptr,
    s_ptr,
    w2_ptr,
    o_ptr,
    o2_ptr,
    n,
    stride_x,
    stride_h,
    stride_o,
    stride_o2,
    eps,
    HAS_SCALAR: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    # The weights before waiting on the kernel that computed h.
    w, scalar, w2 = norm_weights(w_ptr, s_ptr, w2_ptr, offs, mask, HAS_SCALAR, HAS_NEXT)
    wait_for_producer(PDL)
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    o_row, o2_row = o_ptr + row * stride_o, o2_ptr + row * stride_o2
    residual_norm_row(x, h, w, scalar, w2, o_row, o2_row, offs, mask, n, eps, HAS_SCALAR, HAS_NEXT)


@triton.jit
def norm_weights(
    w_ptr, s_ptr, w2_ptr, offs, mask, HAS_SCALAR: tl.constexpr, HAS_NEXT: tl.constexpr
):
    """(w, layer scalar, next w) of residual_norm_row in fp32; the unused ones are placeholders."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scalar = tl.load(s_ptr).to(tl.float32) if HAS_SCALAR else 1.0
    w2 = tl.load(w2_ptr + offs, mask=mask, other=0.0).to(tl.float32) if HAS_NEXT else w
    return w, scalar, w2


@triton.jit
def residual_norm_row(
    x,
    h,
    w,
    scalar,
    w2,
    o_row,
    o2_row,
    offs,
    mask,
    n,
    eps,
    HAS_SCALAR: tl.constexpr,
    HAS_NEXT: tl.constexpr,
):
    """Store y = round(x + norm(h) * w) (times the scalar) at o_row, and norm(y) * w2 at o2_row:
    one row of rmsnorm_residual_add from fp32 operands."""
    DT: tl.constexpr = o_row.dtype.element_ty
    normed = round_to(h * tl.math.rsqrt(tl.sum(h * h, axis=0) / n + eps) * w, DT)
    y = round_to(x + normed, DT)
    if HAS_SCALAR:  # layer_scalar scales the residual stream after the add (docs/gemma4.md §3.4)
        y = round_to(y * scalar, DT)
    tl.store(o_row + offs, y.to(DT), mask=mask)
    if HAS_NEXT:  # the next sublayer's input norm of the new residual, while it is in registers
        z = y * tl.math.rsqrt(tl.sum(y * y, axis=0) / n + eps) * w2
        tl.store(o2_row + offs, round_to(z, DT).to(DT), mask=mask)


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    o_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    eps,
    HAS_W: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    HALF: tl.constexpr = HEAD_DIM // 2
    DT: tl.constexpr = o_ptr.dtype.element_ty
    mask = (h < num_heads)[:, None]
    rows = x_ptr + t * stride_xt + h[:, None] * stride_xh
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    # The partner of dim d in the half-split rotation is d + hd/2 (mod hd); reload it rather than
    # shuffle lanes.
    d_rot = (d + HALF) % HEAD_DIM
    x_rot = tl.load(rows + d_rot[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x * inv
    y_rot = x_rot * inv
    if HAS_W:
        y = y * tl.load(w_ptr + d).to(tl.float32)[None, :]
        y_rot = y_rot * tl.load(w_ptr + d_rot).to(tl.float32)[None, :]
    y = round_to(y, DT)
    y_rot = round_to(tl.where(d[None, :] < HALF, -y_rot, y_rot), DT)
    c = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + d).to(tl.float32)[None, :]
    out = round_to(round_to(y * c, DT) + round_to(y_rot * s, DT), DT)
    tl.store(o_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(DT), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape); weight None: the scale-free v_norm or
    router norm."""
    if x.dim() == 3 and x.stride(-1) == 1:  # [T, heads, hd], possibly a strided view: no copy
        x3 = x
    else:
        x3 = _rows(x).unsqueeze(1)
    outer, inner, n = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if outer * inner:
        block = next_pow2(n)
        _rms_norm_kernel[(outer * inner,)](
            x3,
            weight if weight is not None else x3,
            out,
            n,
            inner,
            x3.stride(0),
            x3.stride(1),
            n,
            eps,
            HAS_W=weight is not None,
            BLOCK=block,
            num_warps=row_warps(block),
            **pdl_args(x.device),
        )
    return out


def rmsnorm_residual_add(
    x: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    layer_scalar: torch.Tensor | None = None,
    next_weight: torch.Tensor | None = None,
    num_warps: int | None = None,
):
    """y = x + RMSNorm(h; weight), then `* layer_scalar` when given (a 1-element tensor), rounded
    like the torch ops. With `next_weight`, returns (y, RMSNorm(y; next_weight)): the next
    sublayer's normed input too. `num_warps` overrides the row's warps (benchmarks)."""
    assert x.shape == h.shape and x.dtype == h.dtype
    x2, h2 = _rows(x), _rows(h)
    n = x2.shape[1]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    out2 = torch.empty_like(out) if next_weight is not None else out
    if x2.shape[0]:
        block = next_pow2(n)
        _residual_norm_kernel[(x2.shape[0],)](
            x2,
            h2,
            weight,
            layer_scalar if layer_scalar is not None else weight,
            next_weight if next_weight is not None else weight,
            out,
            out2,
            n,
            x2.stride(0),
            h2.stride(0),
            out.stride(0),
            out2.stride(0),
            eps,
            HAS_SCALAR=layer_scalar is not None,
            HAS_NEXT=next_weight is not None,
            BLOCK=block,
            num_warps=num_warps or row_warps(block),
            **pdl_args(x.device),
        )
    if next_weight is None:
        return out.view(x.shape)
    return out.view(x.shape), out2.view(x.shape)


def rmsnorm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight), cos, sin) for x [T, heads, hd] (q_norm/k_norm and
    half-split RoPE); cos/sin [T, hd] in the model dtype."""
    T, heads, hd = x.shape
    assert hd & (hd - 1) == 0 and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T:
        block_h = min(next_pow2(heads), max(1, 4096 // hd))
        _norm_rope_kernel[(T, triton.cdiv(heads, block_h))](
            x,
            weight if weight is not None else x,
            cos,
            sin,
            out,
            heads,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            sin.stride(0),
            eps,
            HAS_W=weight is not None,
            HEAD_DIM=hd,
            BLOCK_H=block_h,
            num_warps=row_warps(block_h * hd),
            **pdl_args(x.device),
        )
    return out
