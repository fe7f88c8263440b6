"""What a step derives from its positions before the first layer: RoPE tables and KV write slots.

In torch each is a chain of small launches (positions to float, the angle product, cat, cos, sin,
two casts per layer kind; a gather, divisions and casts per page table) at the start of every
graphed step. Here each is one launch with the torch ops' rounding points: the angle is the same
fp32 product, and cos and sin are libdevice's (what torch's CUDA kernels call; `tl.cos` is an
approximation), rounded once to the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from ._common import INTERPRET, round_to


# One compiled variant each, whatever the step's token count (a new block size or integer
# specialisation would compile mid-serving, on the first prefill of an unseen length).
@triton.jit(do_not_specialize=["T"])
def _rope_tables_kernel(
    pos_ptr,
    inv_ptr,
    cos_ptr,
    sin_ptr,
    T,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, 2 * HALF)
    ok = (t < T)[:, None]
    theta = (
        tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)[:, None]
        * tl.load(inv_ptr + d % HALF)[None, :]
    )
    if LIBDEVICE:
        c, s = libdevice.cos(theta), libdevice.sin(theta)
    else:  # the interpreter has no libdevice
        c, s = tl.cos(theta), tl.sin(theta)
    DT: tl.constexpr = cos_ptr.dtype.element_ty
    out = t[:, None] * (2 * HALF) + d[None, :]
    tl.store(cos_ptr + out, round_to(c, DT).to(DT), mask=ok)
    tl.store(sin_ptr + out, round_to(s, DT).to(DT), mask=ok)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) [T, 2 * len(inv_freq)] in `dtype` of the angles positions x inv_freq (fp32), in
    the half-split layout (the angle table twice), as layers.rope_cos_sin."""
    T, half = positions.shape[0], inv_freq.shape[0]
    assert half & (half - 1) == 0 and positions.is_contiguous() and inv_freq.dtype == torch.float32
    cos = torch.empty(T, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if T:
        # 1024 values a program: a verify step's ~100 rows spread over SMs (sin/cos bind it).
        block_t = max(1, 1024 // (2 * half))
        _rope_tables_kernel[(triton.cdiv(T, block_t),)](
            positions,
            inv_freq,
            cos,
            sin,
            T,
            HALF=half,
            BLOCK_T=block_t,
            LIBDEVICE=not INTERPRET,
            num_warps=4,
        )
    return cos, sin


@triton.jit(do_not_specialize=["stride_a", "stride_b", "T"])
def _write_slots_kernel(
    token_seq_ptr,
    pos_ptr,
    table_a_ptr,
    table_b_ptr,
    stride_a,
    stride_b,
    kv_end_ptr,
    slot_a_ptr,
    slot_b_ptr,
    T,
    PAGE_A: tl.constexpr,
    PAGE_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < T
    pos = tl.load(pos_ptr + t, mask=ok, other=0).to(tl.int64)
    row = tl.load(token_seq_ptr + t, mask=ok, other=0).to(tl.int64)
    page_a = tl.load(table_a_ptr + row * stride_a + pos // PAGE_A, mask=ok, other=0).to(tl.int64)
    page_b = tl.load(table_b_ptr + row * stride_b + pos // PAGE_B, mask=ok, other=0).to(tl.int64)
    tl.store(slot_a_ptr + t, page_a * PAGE_A + pos % PAGE_A, mask=ok)
    tl.store(slot_b_ptr + t, page_b * PAGE_B + pos % PAGE_B, mask=ok)
    tl.store(kv_end_ptr + t, (pos + 1).to(tl.int32), mask=ok)


def write_slots(token_seq: torch.Tensor, pos: torch.Tensor, tables: dict, page_tokens: dict):
    """(kv_end [T] int32 = pos + 1, {kind: slot [T] int64}), as attention.metadata.causal_metadata.

    The slot is where each token's K/V goes, through its sequence's row of each of the two page
    tables: page * page_tokens[kind] + offset.
    """
    # By kind name, not the dict's order (which follows the order a sequence's kinds got pages):
    # the page sizes are compile-time constants.
    (kind_a, table_a), (kind_b, table_b) = sorted(tables.items())
    T = pos.shape[0]
    assert (
        token_seq.is_contiguous()
        and pos.is_contiguous()
        and table_a.stride(1) == 1
        and table_b.stride(1) == 1
    )
    kv_end = torch.empty(T, dtype=torch.int32, device=pos.device)
    slot_a = torch.empty(T, dtype=torch.int64, device=pos.device)
    slot_b = torch.empty_like(slot_a)
    if T:
        block = 128
        _write_slots_kernel[(triton.cdiv(T, block),)](
            token_seq,
            pos,
            table_a,
            table_b,
            table_a.stride(0),
            table_b.stride(0),
            kv_end,
            slot_a,
            slot_b,
            T,
            PAGE_A=page_tokens[kind_a],
            PAGE_B=page_tokens[kind_b],
            BLOCK=block,
            num_warps=4,
        )
    return kv_end, {kind_a: slot_a, kind_b: slot_b}
