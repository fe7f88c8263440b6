"""Each row's first maximum of values already in memory, in two launches.

For rows the greedy head does not take (more than the GEMV's 16): the LM head's bf16 logits come
from cuBLAS, and torch would softcap them in three elementwise passes before its argmax. Here the
softcap's `table` (greedy_head.value_table) is read only at each chunk's largest raw logit: the
softcap is non-decreasing, so the logits holding the chunk's largest softcapped value are those at
or above that logit's `floor` (greedy_head.floor_table), the smallest bf16 value the softcap takes
to the same value. For the drafter's centroid head the columns carry their token `ids`, and the
row's smallest raw value comes along (its fill is derived from it).

Ties go to the lowest id and NaN is the largest value, as in torch's argmax; the values and ids
are exactly torch's (on a row holding a NaN, `least` is not defined).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import pdl_args, wait_for_producer

CHUNK = 4096  # columns per program: 64 programs a row at a 262,144-token vocabulary
NO_ID = tl.constexpr(2**61)  # above every id, and twice it is an int64: see first_at_least


@triton.jit
def first_at_least(values, floor, best, ids, none):
    """(best, the lowest of ids whose value is at least floor), unless a value is NaN: then (NaN,
    the lowest id holding a NaN), as torch's argmax takes NaN for the largest value. Ids equal to
    `none` (above every id) are skipped; with no id left the id is `none`. One reduction: a NaN's
    key is its id, a hit's its id + none, the rest 2 * none."""
    key = tl.where(values != values, ids, tl.where(values >= floor, ids + none, 2 * none))
    first = tl.min(tl.where(ids < none, key, 2 * none), axis=0)
    nan = first < none
    return tl.where(nan, float("nan"), best), tl.where(nan, first, first - none)


@triton.jit
def first_of_max(values, ids, none):
    """The largest of 1-D values and the lowest of ids holding it, NaN the largest value (see
    first_at_least; tl.max alone skips NaN)."""
    best = tl.max(values, axis=0)
    return first_at_least(values, best, best, ids, none)


@triton.jit
def _chunk_kernel(
    values_ptr,
    ids_ptr,
    table_ptr,
    floor_ptr,
    best_ptr,
    best_id_ptr,
    least_ptr,
    N,
    P,
    stride_v,
    stride_i,
    CHUNK: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_TABLE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (row, chunk): the largest mapped value, the lowest id holding it, the least raw value."""
    wait_for_producer(PDL)
    m = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = p * CHUNK + tl.arange(0, CHUNK)
    inside = n < N
    raw = tl.load(values_ptr + m * stride_v + n, mask=inside, other=float("-inf")).to(tl.float32)
    top = tl.max(raw, axis=0)  # skips NaN (first_at_least finds them)
    if HAS_TABLE:  # the table's value at the top logit, held by every logit from its floor up
        bits = top.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        best, floor = tl.load(table_ptr + bits), tl.load(floor_ptr + bits)
    else:
        best, floor = top, top
    if HAS_IDS:
        ids = tl.load(ids_ptr + m * stride_i + n, mask=inside, other=0).to(tl.int64)
    else:
        ids = n.to(tl.int64)
    g_max, first = first_at_least(raw, floor, best, tl.where(inside, ids, NO_ID), NO_ID)
    tl.store(best_ptr + m * P + p, g_max)
    tl.store(best_id_ptr + m * P + p, first)
    least = tl.where(inside, raw, float("inf"))
    tl.store(least_ptr + m * P + p, tl.min(least, axis=0))


@triton.jit
def _combine_kernel(
    best_ptr,
    best_id_ptr,
    least_ptr,
    tokens_ptr,
    values_ptr,
    row_least_ptr,
    P,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per row, over its chunks: the first maximum and the smallest raw value."""
    wait_for_producer(PDL)
    m = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK)
    g = tl.load(best_ptr + m * P + p, mask=p < P, other=float("-inf"))
    i = tl.load(best_id_ptr + m * P + p, mask=p < P, other=NO_ID)
    g_max, first = first_of_max(g, i, NO_ID)
    tl.store(tokens_ptr + m, first)
    tl.store(values_ptr + m, g_max)
    least = tl.load(least_ptr + m * P + p, mask=p < P, other=float("inf"))
    tl.store(row_least_ptr + m, tl.min(least, axis=0))


def first_max(
    values: torch.Tensor,
    table: torch.Tensor | None = None,
    floor: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For values [M, N] (unit stride along N): (tokens [M] int64, best [M] fp32, least [M] fp32).

    best is each row's largest table[values] (values themselves without a table), tokens the lowest
    of ids [M, N] (the column index without ids) holding it, least the row's smallest raw value.
    The table maps a bf16 bit pattern to fp32 (65,536 entries), so it needs bf16 values, and must
    be non-decreasing in the value; floor is its greedy_head.floor_table.
    """
    M, N = values.shape
    assert values.stride(1) == 1
    assert ids is None or (ids.shape == values.shape and ids.stride(1) == 1)
    assert (table is None) == (floor is None)
    assert table is None or (values.dtype == torch.bfloat16 and table.numel() == 65536)
    dev = values.device
    chunk = min(CHUNK, triton.next_power_of_2(N))
    P = triton.cdiv(N, chunk)
    f32 = dict(dtype=torch.float32, device=dev)
    best, least = torch.empty(M, P, **f32), torch.empty(M, P, **f32)
    best_id = torch.empty(M, P, dtype=torch.int64, device=dev)
    _chunk_kernel[(M, P)](
        values,
        values if ids is None else ids,
        values if table is None else table,
        values if floor is None else floor,
        best,
        best_id,
        least,
        N,
        P,
        values.stride(0),
        0 if ids is None else ids.stride(0),
        CHUNK=chunk,
        HAS_IDS=ids is not None,
        HAS_TABLE=table is not None,
        num_warps=4,
        **pdl_args(dev),
    )
    tokens = torch.empty(M, dtype=torch.int64, device=dev)
    row_best, row_least = torch.empty(M, **f32), torch.empty(M, **f32)
    _combine_kernel[(M,)](
        best, best_id, least, tokens, row_best, row_least, P,
        BLOCK=triton.next_power_of_2(P), **pdl_args(dev),
    )  # fmt: skip
    return tokens, row_best, row_least
