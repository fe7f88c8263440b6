"""Greedy decoding's LM head, exactly, without reading all of it in bf16.

A greedy row needs only the first argmax of G(logits), where logits = bf16(x @ W^T) is what `gemv` computes and
G is the model's softcap as its torch ops round it (a monotone function of one bf16 value, so a 65,536-entry
table `lut` holds it exactly). Four launches find it while reading W mostly as an int8 copy (half the bytes;
the 31B's head is 2.8 GB in bf16):

1. |x|_1 per row, then the screen: the int8 head (one fp32 scale per row, q = round(w / scale)) gives each logit an interval that
   surely holds the fp32 sum S the bf16 GEMV computes: |S - scale * (x @ q)| <= 0.625 * scale * |x|_1
   (0.5 * scale for the rounding of q, 0.124 * scale for the fp32 accumulation of both sums, far above their
   worst case). It stores G(bf16(upper end)) and each tile's largest lower end (T = the largest of all).
2. exact: a token whose G(upper end) < G(T) cannot be the argmax (some token's S is >= T, and G is monotone),
   so every program keeps its rows with G(upper) >= G(T), packs them in order and computes their logits with
   the GEMV's own tiles and accumulation order, so each value is bit-identical to `gemv`'s; it keeps the
   first maximum of G per row.
3. pick: the first maximum over the programs.

Every token that ties for the maximum is a candidate, so ties go to the lowest id as `torch.argmax` does: the
tokens equal the argmax of the full head's softcapped logits, whatever the weights. Only the speed depends on
them: random N(0, 0.02) weights leave a few thousand candidates per row (~1%).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_in_fp32, pdl_args, round_to, wait_for_producer
from .gemv import MAX_ROWS, _dot, _in_split, _k_splits, gemv_config

BOUND = tl.constexpr(0.625)  # interval half-width per unit of scale * |x|_1 (see above)
ROWS_PER_PROGRAM = 512  # vocabulary rows each exact program screens and packs
# (BN, BK, num_warps, num_stages) of the int8 screen: the fastest of six at the 31B's head, M = 1 and 5 (H200)
SCREEN_CONFIG = (128, 256, 4, 3)


@triton.jit
def _lookup(lut_ptr, v, mask):
    """G(bf16(v)) for fp32 v: the table entry of v's bf16 bit pattern."""
    bits = round_to(v, tl.bfloat16).to(tl.uint32, bitcast=True) >> 16
    return tl.load(lut_ptr + bits, mask=mask, other=float("-inf"))


@triton.jit
def _l1_kernel(x_ptr, l1_ptr, K, stride_xm, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    m = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        acc += tl.abs(tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32))
    tl.store(l1_ptr + m, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["M"])
def _screen_kernel(x_ptr, q_ptr, scale_ptr, lut_ptr, l1_ptr, ghi_ptr, lo_ptr, M, N, K, stride_xm, stride_qn,
                   stride_gm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   PDL: tl.constexpr, DOT_FP32: tl.constexpr):
    tile = tl.program_id(0)
    n = tile * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_ok = (n < N)[:, None]
    m_ok = (m < M)[:, None]
    DT: tl.constexpr = x_ptr.dtype.element_ty
    w_ptrs = q_ptr + n[:, None].to(tl.int64) * stride_qn + kk[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + kk[None, :]
    w = tl.load(w_ptrs, mask=_in_split(n_ok, 0, kk, K, EVEN_K), other=0, eviction_policy="evict_first")
    wait_for_producer(PDL)
    x = tl.load(x_ptrs, mask=_in_split(m_ok, 0, kk, K, EVEN_K), other=0.0)
    acc = _dot(x, w.to(DT), DT, DOT_FP32)  # |q| <= 127: exact in bf16
    for k0 in range(BK, K, BK):
        k0 = tl.multiple_of(k0, BK)
        w = tl.load(w_ptrs + k0, mask=_in_split(n_ok, k0, kk, K, EVEN_K), other=0, eviction_policy="evict_first")
        x = tl.load(x_ptrs + k0, mask=_in_split(m_ok, k0, kk, K, EVEN_K), other=0.0)
        acc += _dot(x, w.to(DT), DT, DOT_FP32)
    l1 = tl.load(l1_ptr + m, mask=m < M, other=0.0)
    scale = tl.load(scale_ptr + n, mask=n < N, other=0.0)[None, :]
    approx = acc * scale
    bound = BOUND * scale * l1[:, None]
    out_ok = m_ok & (n < N)[None, :]
    g_hi = _lookup(lut_ptr, approx + bound, out_ok)
    tl.store(ghi_ptr + m[:, None] * stride_gm + n[None, :], g_hi.to(tl.bfloat16), mask=out_ok)
    lo = tl.where(out_ok, approx - bound, float("-inf"))
    tl.store(lo_ptr + m * tl.num_programs(0) + tile, tl.max(lo, axis=1), mask=m < M)


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _exact_kernel(x_ptr, w_ptr, lut_ptr, ghi_ptr, lo_ptr, pack_ptr, best_g_ptr, best_i_ptr, M, N, K, k_per_split,
                  tiles, stride_xm, stride_wn, stride_gm, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, SPLIT: tl.constexpr, TILES_P: tl.constexpr, EVEN_K: tl.constexpr,
                  PDL: tl.constexpr, DOT_FP32: tl.constexpr):
    p = tl.program_id(0)
    P = tl.num_programs(0)
    r = p * R + tl.arange(0, R)
    r_ok = r < N
    wait_for_producer(PDL)
    # The rows of this program's range that some row of x may choose (any row's candidates are computed for all
    # rows: an extra exact value never changes an argmax).
    cand = tl.zeros([R], tl.int32)
    t = tl.arange(0, TILES_P)
    for mi in range(M):
        lo = tl.max(tl.load(lo_ptr + mi * tiles + t, mask=t < tiles, other=float("-inf")), axis=0)  # T
        g_t = tl.load(lut_ptr + (round_to(lo, tl.bfloat16).to(tl.uint32, bitcast=True) >> 16))
        g_hi = tl.load(ghi_ptr + mi * stride_gm + r, mask=r_ok, other=float("-inf")).to(tl.float32)
        cand = tl.where(g_hi >= g_t, 1, cand)
    count = tl.sum(cand, axis=0)
    # Pack the candidates in row order (through memory: registers cannot be indexed).
    slot = tl.cumsum(cand, axis=0) - 1
    tl.store(pack_ptr + p * R + slot, r, mask=cand > 0)
    tl.debug_barrier()

    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    m_ok = (m < M)[:, None]
    DT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptrs = x_ptr + m[:, None] * stride_xm + kk[None, :]
    best_g = tl.full([BM], float("-inf"), tl.float32)
    best_i = tl.full([BM], N, tl.int32)
    for g0 in range(0, count, BN):
        j = g0 + tl.arange(0, BN)
        j_ok = j < count
        rows = tl.load(pack_ptr + p * R + j, mask=j_ok, other=0)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + kk[None, :]
        # gemv's tiles and dot order, its K splits (if any) summed in split order: bit-identical sums
        if SPLIT == 1:  # (one loop: the pipeliner skips a loop nested this deep)
            total = tl.zeros([BM, BN], tl.float32)
            for k0 in range(0, K, BK):
                k0 = tl.multiple_of(k0, BK)
                w = tl.load(w_ptrs + k0, mask=_in_split(j_ok[:, None], k0, kk, K, EVEN_K), other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptrs + k0, mask=_in_split(m_ok, k0, kk, K, EVEN_K), other=0.0)
                total += _dot(x, w, DT, DOT_FP32)
        else:
            total = tl.zeros([BM, BN], tl.float32)
            for k_lo in range(0, K, k_per_split):
                k_hi = tl.minimum(k_lo + k_per_split, K)
                acc = tl.zeros([BM, BN], tl.float32)
                for k0 in range(k_lo, k_hi, BK):
                    k0 = tl.multiple_of(k0, BK)
                    w = tl.load(w_ptrs + k0, mask=_in_split(j_ok[:, None], k0, kk, k_hi, EVEN_K), other=0.0,
                                eviction_policy="evict_first")
                    x = tl.load(x_ptrs + k0, mask=_in_split(m_ok, k0, kk, k_hi, EVEN_K), other=0.0)
                    acc += _dot(x, w, DT, DOT_FP32)
                total += acc
        g = _lookup(lut_ptr, total, m_ok & j_ok[None, :])
        g_max = tl.max(g, axis=1)
        first = tl.min(tl.where(g == g_max[:, None], rows[None, :], N), axis=1)
        # groups come in row order: a later group wins only with a strictly larger value
        best_i = tl.where(g_max > best_g, first, best_i)
        best_g = tl.maximum(best_g, g_max)
    tl.store(best_g_ptr + m * P + p, best_g, mask=m < M)
    tl.store(best_i_ptr + m * P + p, best_i, mask=m < M)


@triton.jit
def _pick_kernel(best_g_ptr, best_i_ptr, out_ptr, N, P, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    mi = tl.program_id(0)
    p = tl.arange(0, BLOCK)
    g = tl.load(best_g_ptr + mi * P + p, mask=p < P, other=float("-inf"))
    i = tl.load(best_i_ptr + mi * P + p, mask=p < P, other=N)
    g_max = tl.max(g, axis=0)
    tl.store(out_ptr + mi, tl.min(tl.where(g == g_max, i, N), axis=0).to(tl.int64))


@torch.no_grad()
def quantize_rows(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scale [N]) with w ~ q * scale, scale = max |w_row| / 127, a chunk of rows at a time."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], chunk):
        rows = w[i : i + chunk].float()
        s = rows.abs().amax(dim=1).clamp_min(1e-30) / 127
        q[i : i + chunk] = torch.round(rows / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[i : i + chunk] = s
    return q, scale


def value_table(fn, device: torch.device) -> torch.Tensor:
    """fn (elementwise, bf16 -> bf16) at every bf16 bit pattern, as fp32 [65536]: the table of G."""
    bits = torch.arange(65536, dtype=torch.int32, device=device)
    every = torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)
    return fn(every).float()


def greedy_head(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, lut: torch.Tensor,
                screen: tuple | None = None) -> torch.Tensor:
    """The first argmax over N of lut[bf16(x @ w^T)] per row, for x [M <= MAX_ROWS, K]: [M] int64. q, scale:
    quantize_rows(w); lut: value_table of G. `screen` overrides SCREEN_CONFIG (benchmarks)."""
    M, K = x.shape
    N = w.shape[0]
    assert M <= MAX_ROWS and w.shape[1] == K and q.shape == w.shape and x.stride(1) == 1 and w.stride(1) == 1
    dev = x.device
    l1 = torch.empty(M, dtype=torch.float32, device=dev)
    _l1_kernel[(M,)](x, l1, K, x.stride(0), BLOCK=1024, num_warps=4, **pdl_args(dev))
    bn, bk, warps, stages = screen or SCREEN_CONFIG
    tiles = triton.cdiv(N, bn)
    g_hi = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    lo = torch.empty(M, tiles, dtype=torch.float32, device=dev)
    fp32 = dot_in_fp32(x.dtype)
    _screen_kernel[(tiles,)](
        x, q, scale, lut, l1, g_hi, lo, M, N, K, x.stride(0), q.stride(0), g_hi.stride(0), BM=MAX_ROWS, BN=bn, BK=bk,
        EVEN_K=K % bk == 0, DOT_FP32=fp32, num_warps=warps, num_stages=stages, **pdl_args(dev))
    # the exact values with gemv's own tiles for this shape (bit-identical sums)
    bn, bk, warps, _, split = gemv_config(N, K, dev)
    assert split > 0, "a stream-K head has no per-column summation order to repeat"
    k_per_split, split = _k_splits(K, bk, split)
    R = ROWS_PER_PROGRAM
    P = triton.cdiv(N, R)
    pack = torch.empty(P * R, dtype=torch.int32, device=dev)
    best_g = torch.empty(M, P, dtype=torch.float32, device=dev)
    best_i = torch.empty(M, P, dtype=torch.int32, device=dev)
    # 3 stages, not gemv's 4: 48 KB of shared memory a program, so the 512 programs fit in one wave
    _exact_kernel[(P,)](
        x, w, lut, g_hi, lo, pack, best_g, best_i, M, N, K, k_per_split, tiles, x.stride(0), w.stride(0),
        g_hi.stride(0), R=R, BM=MAX_ROWS, BN=bn, BK=bk, SPLIT=split, TILES_P=triton.next_power_of_2(tiles),
        EVEN_K=K % bk == 0, DOT_FP32=fp32, num_warps=warps, num_stages=3, **pdl_args(dev))
    out = torch.empty(M, dtype=torch.int64, device=dev)
    _pick_kernel[(M,)](best_g, best_i, out, N, P, BLOCK=triton.next_power_of_2(P), **pdl_args(dev))
    return out
