"""Skinny GEMM y = x @ W^T for the few-row steps (decode, verify, the draft loop), streaming W once.

At M <= 16 a step is a read of the weights, so the kernel is built around that read: a column tile of W per
program, the first K tile loaded *before* waiting on the previous kernel. Launched with programmatic dependent
launch (PDL, Hopper), the next GEMM's programs start while the current one drains and have their first weight
bytes in flight when its output lands, which hides the per-kernel ramp that separates cuBLAS from the copy
bandwidth at batch 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_in_fp32, pdl_args, wait_for_producer

MAX_ROWS = 16  # the dot's row tile; larger M goes to cuBLAS


@triton.jit
def _dot(x, w, DT: tl.constexpr, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(x.to(DT), tl.trans(w))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, DOT_FP32: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_ok = (n < N)[:, None]
    m_ok = (m < M)[:, None]
    DT: tl.constexpr = y_ptr.dtype.element_ty
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + kk[None, :]
    # Weights never depend on the previous kernel: start reading them before waiting for it.
    w = tl.load(w_ptrs, mask=n_ok & (kk < K)[None, :], other=0.0, eviction_policy="evict_first")
    wait_for_producer(PDL)
    x = tl.load(x_ptrs, mask=m_ok & (kk < K)[None, :], other=0.0)
    acc = _dot(x, w, DT, DOT_FP32)
    for k0 in range(BK, K, BK):
        k_ok = (k0 + kk < K)[None, :]
        w = tl.load(w_ptrs + k0, mask=n_ok & k_ok, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs + k0, mask=m_ok & k_ok, other=0.0)
        acc += _dot(x, w, DT, DOT_FP32)
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(DT), mask=m_ok & (n < N)[None, :])


def gemv_config(n: int) -> tuple:
    """(BN, BK, num_warps, num_stages): wide tiles for wide outputs, narrower ones where N alone would leave
    the GPU under-filled (bench/bench_gemv.py's sweep on an H200)."""
    return (64, 256, 4, 3) if n >= 16384 else (32, 256, 4, 4)


def gemv(x: torch.Tensor, w: torch.Tensor, config: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] for M <= MAX_ROWS."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= MAX_ROWS and w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config or gemv_config(N)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BM=MAX_ROWS, BN=bn, BK=bk,
        DOT_FP32=dot_in_fp32(x.dtype), num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return y
