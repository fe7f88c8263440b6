"""MoE for Gemma 4 26B-A4B (docs/gemma4.md §5): fused routing and a grouped expert GEMM path.

- `moe_route`: router logits [T, E] -> fp32 softmax over all experts -> top-k (lowest id first on
  ties) -> renormalise over the k -> × per_expert_scale. One launch.
- `moe_align`: sorts the T·k (token, slot) pairs by expert into BLOCK_M-row blocks, each block owned
  by one expert (padding rows carry the sentinel T·k). Three small launches, all on device: the
  sizes depend only on T, k and E, so nothing syncs with the host and CUDA graphs can capture it.
- `moe_experts`: grouped GEMM 1 (gate and up tiles of the same columns in one program, GELU·up in
  its epilogue), grouped GEMM 2 (down), then the fp32 weighted sum of each token's k outputs,
  rounded once (HF grouped_mm semantics, `moe_experts` in gemma4serve/model/layers.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_in_fp32, next_pow2, round_to
from .activation import gelu_times


# ------------------------------------------------------------------------------------------ routing
@triton.jit
def _route_kernel(
    logit_ptr,
    scale_ptr,
    w_ptr,
    id_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    K_P: tl.constexpr,
    E_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P)
    ok = e < num_experts
    logits = tl.load(logit_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = p / tl.sum(p, axis=0)
    cur = tl.where(ok, p, -1.0)
    kk = tl.arange(0, K_P)
    top_w = tl.zeros([K_P], tl.float32)
    top_i = tl.zeros([K_P], tl.int32)
    for i in tl.static_range(TOP_K):  # k rounds of argmax: descending order like torch.topk
        best = tl.max(cur, axis=0)
        idx = tl.min(tl.where(cur == best, e, E_P), axis=0)
        top_w = tl.where(kk == i, best, top_w)
        top_i = tl.where(kk == i, idx, top_i)
        cur = tl.where(e == idx, -1.0, cur)
    kok = kk < TOP_K
    scale = tl.load(scale_ptr + top_i, mask=kok, other=0.0).to(tl.float32)
    w = top_w / tl.sum(top_w, axis=0) * scale
    tl.store(w_ptr + t * TOP_K + kk, w, mask=kok)
    tl.store(id_ptr + t * TOP_K + kk, top_i, mask=kok)


def moe_route(logits: torch.Tensor, per_expert_scale: torch.Tensor, top_k: int):
    """logits [T, E] (any float dtype) -> (weights [T, k] fp32, expert ids [T, k] int32)."""
    T, E = logits.shape
    assert logits.stride(-1) == 1
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        _route_kernel[(T,)](
            logits,
            per_expert_scale,
            weights,
            ids,
            E,
            logits.stride(0),
            TOP_K=top_k,
            K_P=next_pow2(top_k),
            E_P=next_pow2(E),
            num_warps=1 if E <= 256 else 4,
        )
    return weights, ids


# ---------------------------------------------------------------------------------------- alignment
# Token counts are plain arguments everywhere (not specialised on ==1 / divisibility by 16): each
# batch size would otherwise compile new variants while serving.
@triton.jit(do_not_specialize=["num_pairs", "chunk"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, chunk, E_P: tl.constexpr, SUB: tl.constexpr):
    c = tl.program_id(0)
    eo = tl.arange(0, E_P)
    cnt = tl.zeros([E_P], tl.int32)
    chunk_end = tl.minimum((c + 1) * chunk, num_pairs)
    for s in range(c * chunk, chunk_end, SUB):
        p = s + tl.arange(0, SUB)
        e = tl.load(ids_ptr + p, mask=p < chunk_end, other=-1)
        cnt += tl.sum((e[:, None] == eo[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * E_P + eo, cnt)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _offsets_kernel(
    counts_ptr,
    base_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    max_blocks,
    C: tl.constexpr,
    E_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    cc = tl.arange(0, C)
    eo = tl.arange(0, E_P)
    counts = tl.load(counts_ptr + cc[:, None] * E_P + eo[None, :])  # [chunks, experts]
    total = tl.sum(counts, axis=0)
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    # Each chunk's first slot per expert: the expert's segment start + the pairs of earlier chunks.
    tl.store(
        base_ptr + cc[:, None] * E_P + eo[None, :],
        pad_start[None, :] + tl.cumsum(counts, axis=0) - counts,
    )
    r = tl.arange(0, BLOCK_M)
    pad_slot = (pad_start + total)[:, None] + r[None, :]
    tl.store(sorted_ptr + pad_slot, num_pairs, mask=pad_slot < pad_end[:, None])
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        # The owner of block b is the number of experts whose segment ends at or before its first
        # row (>= E past the last segment: the GEMMs skip those blocks).
        owner = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b < max_blocks)


@triton.jit(do_not_specialize=["num_pairs", "chunk"])
def _scatter_kernel(
    ids_ptr, base_ptr, sorted_ptr, num_pairs, chunk, E_P: tl.constexpr, SUB: tl.constexpr
):
    c = tl.program_id(0)
    eo = tl.arange(0, E_P)
    run = tl.load(base_ptr + c * E_P + eo)
    chunk_end = tl.minimum((c + 1) * chunk, num_pairs)
    for s in range(c * chunk, chunk_end, SUB):
        p = s + tl.arange(0, SUB)
        ok = p < chunk_end
        e = tl.load(ids_ptr + p, mask=ok, other=-1)
        onehot = (e[:, None] == eo[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in this sub-block
        dest = tl.sum(onehot * (before + run[None, :]), axis=1)
        tl.store(sorted_ptr + dest, p, mask=ok)
        run += tl.sum(onehot, axis=0)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int):
    """ids [T, k] -> (sorted pair indices [max_blocks * block_m] int32, owning expert per block
    [max_blocks] int32).

    Pair p = t*k + j. Every expert's pairs fill whole blocks of block_m rows (padding = T*k); blocks
    past the used ones have owner >= num_experts. max_blocks is a host bound:
    cdiv(T*k, block_m) + min(E, T*k).
    """
    ids = ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    n = ids.numel()
    dev = ids.device
    e_p = next_pow2(num_experts)
    max_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    sub = 64
    chunks = min(64, next_pow2(triton.cdiv(n, sub)))
    chunk = triton.cdiv(triton.cdiv(n, chunks), sub) * sub
    counts = torch.empty(chunks, e_p, dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    _count_kernel[(chunks,)](ids, counts, n, chunk, E_P=e_p, SUB=sub, num_warps=4)
    _offsets_kernel[(1,)](
        counts,
        base,
        sorted_pairs,
        block_expert,
        n,
        max_blocks,
        C=chunks,
        E_P=e_p,
        BLOCK_M=block_m,
        BLOCK_B=64,
        num_warps=4,
    )
    _scatter_kernel[(chunks,)](ids, base, sorted_pairs, n, chunk, E_P=e_p, SUB=sub, num_warps=4)
    return sorted_pairs, block_expert


# ------------------------------------------------------------------------------------ grouped GEMMs
@triton.jit
def _mma(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    n_out,
    k_in,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_cm,
    ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """C[pair, n] = A[pair // ROW_DIV] @ W[expert]ᵀ for the rows of one expert-owned block.

    GATED: W holds [gate; up] (2·n_out rows) and C = gelu_tanh(gate) * up, with the reference's
    roundings.
    """
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = (tl.where(row_ok, pairs, 0) // ROW_DIV).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    kk = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + kk
        k_ok = k < k_in
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = n_ok[None, :] & k_ok[:, None]
        w = tl.load(w_e + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc = _mma(a, w, acc, DOT_FP32)
        if GATED:
            w_up = tl.load(
                w_e + (n + n_out)[None, :] * stride_wn + k[:, None] * stride_wk,
                mask=w_mask,
                other=0.0,
            )
            acc_up = _mma(a, w_up, acc_up, DOT_FP32)
    DT: tl.constexpr = c_ptr.dtype.element_ty
    y = round_to(acc, DT)  # the projection output in the model dtype
    if GATED:
        y = gelu_times(y, round_to(acc_up, DT), DT)
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c, y.to(DT), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _weighted_sum_kernel(
    y_ptr, w_ptr, o_ptr, hidden, stride_y, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):  # fp32 sum in slot order, one rounding at the end
        y = tl.load(y_ptr + (t * TOP_K + j) * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc += y * tl.load(w_ptr + t * TOP_K + j)
    DT: tl.constexpr = o_ptr.dtype.element_ty
    tl.store(o_ptr + t * stride_o + offs, round_to(acc, DT).to(DT), mask=mask)


def moe_config(num_pairs: int, num_experts: int) -> dict:
    """Tiles by the mean rows per expert: decode gives each expert a handful of rows (bound by the
    weight reads), prefill hundreds. Starting points to tune on the GPU."""
    rows = num_pairs / max(1, num_experts)
    if rows <= 16:
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows <= 64:
        return dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=4)
    return dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def _tile(block: int, dim: int) -> int:
    return max(16, min(block, next_pow2(dim)))


def moe_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:
    """[T, H] = round(Σ_j weights[t, j] · expert_{ids[t, j]}(x[t])).

    x [T, H] (already normed by pre_feedforward_layernorm_2), gate_up_proj [E, 2I, H], down_proj
    [E, H, I], weights [T, k] fp32, ids [T, k].
    """
    T, H = x.shape
    E, I2, _ = gate_up_proj.shape
    inter = I2 // 2
    top_k = ids.shape[1]
    n = T * top_k
    out = torch.empty_like(x)
    if T == 0:
        return out
    assert x.stride(-1) == 1 and gate_up_proj.stride(-1) == 1 and down_proj.stride(-1) == 1
    cfg = moe_config(n, E)
    if config:
        cfg.update(config)
    bm = cfg["block_m"]
    sorted_pairs, block_expert = moe_align(ids, E, bm)
    blocks = block_expert.shape[0]
    fp32 = dot_in_fp32(x.dtype)
    weights = weights.contiguous()

    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    bn, bk = _tile(cfg["block_n"], inter), _tile(cfg["block_k"], H)
    _moe_gemm_kernel[(blocks, triton.cdiv(inter, bn))](
        x,
        gate_up_proj,
        act,
        sorted_pairs,
        block_expert,
        n,
        E,
        inter,
        H,
        x.stride(0),
        gate_up_proj.stride(0),
        gate_up_proj.stride(1),
        gate_up_proj.stride(2),
        act.stride(0),
        ROW_DIV=top_k,
        GATED=True,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_FP32=fp32,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )

    y = torch.empty(n, H, dtype=x.dtype, device=x.device)
    bn, bk = _tile(cfg["block_n"], H), _tile(cfg["block_k"], inter)
    _moe_gemm_kernel[(blocks, triton.cdiv(H, bn))](
        act,
        down_proj,
        y,
        sorted_pairs,
        block_expert,
        n,
        E,
        H,
        inter,
        act.stride(0),
        down_proj.stride(0),
        down_proj.stride(1),
        down_proj.stride(2),
        y.stride(0),
        ROW_DIV=1,
        GATED=False,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_FP32=fp32,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )

    block = min(1024, next_pow2(H))
    _weighted_sum_kernel[(T, triton.cdiv(H, block))](
        y, weights, out, H, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out
