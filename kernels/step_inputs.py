"""The RoPE tables a step derives from its positions before the first layer, in one launch per layer kind.

In torch they are a chain of seven small launches per kind (positions to float, the angle product, cat, cos,
sin, two casts), about 2 us each at batch 1, where they run back to back with the step inside its CUDA graph.
Here the torch ops' rounding points are kept: the angle is the same fp32 product, cos and sin are libdevice's
(what torch's CUDA kernels call; `tl.cos` is an approximation), rounded once to the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from ._common import INTERPRET, next_pow2, round_to


@triton.jit
def _rope_tables_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                        LIBDEVICE: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, 2 * HALF)
    ok = (t < T)[:, None]
    theta = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)[:, None] * tl.load(inv_ptr + d % HALF)[None, :]
    if LIBDEVICE:
        c, s = libdevice.cos(theta), libdevice.sin(theta)
    else:  # the interpreter has no libdevice
        c, s = tl.cos(theta), tl.sin(theta)
    DT: tl.constexpr = cos_ptr.dtype.element_ty
    out = t[:, None] * (2 * HALF) + d[None, :]
    tl.store(cos_ptr + out, round_to(c, DT).to(DT), mask=ok)
    tl.store(sin_ptr + out, round_to(s, DT).to(DT), mask=ok)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) [T, 2 * len(inv_freq)] in `dtype` of the angles positions x inv_freq (fp32), the half-split
    layout (the angle table repeated twice), as layers.rope_cos_sin."""
    T, half = positions.shape[0], inv_freq.shape[0]
    assert half & (half - 1) == 0 and positions.is_contiguous() and inv_freq.dtype == torch.float32
    cos = torch.empty(T, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if T:
        block_t = max(1, min(next_pow2(T), 4096 // (2 * half)))
        _rope_tables_kernel[(triton.cdiv(T, block_t),)](positions, inv_freq, cos, sin, T, HALF=half, BLOCK_T=block_t,
                                                         LIBDEVICE=not INTERPRET, num_warps=4)
    return cos, sin
