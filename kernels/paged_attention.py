"""Paged attention over the layout of gemma4serve/attention/metadata.py, one kernel for all phases.

Prefill/extend chunks, single-token decode, k+1-row causal verification and the drafter's query-only
reads all go through `paged_attention`: query token t (of page-table row `token_seq[t]`) attends to
the keys at positions [max(0, kv_end[t] - window), kv_end[t]) read through the page table. Gemma 4
numerics: scaling 1.0, no softcap, GQA with contiguous head groups, softmax in fp32 (online, exp2
domain), output in q's dtype.

Work split. A program owns one KV head of one sequence group (rows cu_seqlens_q[g] to
cu_seqlens_q[g+1]), a block of BLOCK_T consecutive query tokens of that group and all GROUP query
heads that share the KV head, so every K/V tile is read once for BLOCK_T * GROUP query rows (the
rows of the tl.dot). The KV range of the block [min start, max end) is split across num_splits
programs (flash-decoding) when the grid would otherwise be too small to fill the GPU (batch-1
decode of a long context); a second kernel merges the partial results through their log-sum-exp.
Prefill tiles of 512-wide heads may split the value columns over programs instead (each computes
the scores of its rows, and keeps an accumulator of half the width).
Decode and verification give each group max_q_len rows of programs (one block). Prefill chunks
number the query blocks of all groups in one flat axis instead: a grid of groups x the longest
chunk's blocks would be mostly programs with no rows when a long chunk shares the step with many
short groups. In such a launch the groups of a few rows (decodes, verifications, a prompt's short
tail) take short tiles of their own, and the blocks run from the last on, so the chunks' long
programs start first.
The grid depends only on host ints (tokens, groups, max_q_len, heads, splits) and the loop bounds
come from the metadata tensors, so there is no host synchronisation and CUDA graphs can capture the
launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import (
    INTERPRET,
    cdiv,
    dot_in_fp32,
    next_pow2,
    pdl_args,
    round_to,
    sm_count,
    wait_for_producer,
)

LOG2E = tl.constexpr(1.4426950408889634)  # scores are kept in the exp2 domain
# page-table entries a program holds in registers (more where one key tile needs more)
TABLE_CHUNK = 32
# Programs of 128-row prefill tiles a launch needs before they beat the 64-row ones, by value
# parts (docs/performance.md, H200): with fewer, SMs idle while the longest (causal) programs run.
WIDE_TILE_PROGRAMS = {1: 256, 2: 1024}
# A launch of at least LONG_PREFIX_TOKENS rows whose chunks reach LONG_PREFIX positions: every
# program reads many key tiles, so on the 512-wide heads the split 128-row tiles win with fewer
# programs (docs/performance.md, H200: every model's full layers from 1024 rows over 8192).
LONG_PREFIX = 8192
LONG_PREFIX_TOKENS = 1024
MAX_SPLITS = 64  # KV splits of a launch at most


def table_chunk(page_size: int, block_n: int) -> tuple[int, int]:
    """(table entries held, key tiles whose pages surely lie in them from the first tile's page on,
    whatever the first tile's offset in its page)."""
    entries = max(TABLE_CHUNK, next_pow2(cdiv(block_n + page_size - 1, page_size)))
    return entries, (entries * page_size - page_size + 1) // block_n


@triton.jit
def _attend_keys(
    q,
    k_ptr,
    v_ptr,
    m_i,
    l_i,
    acc,
    pos,
    kv_ok,
    page,
    masked,
    start,
    end,
    kvh,
    d,
    dv,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    PAGE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Keys at positions `pos` (loaded where kv_ok, from pages `page`) into the online softmax.

    Unless `masked` is false (every row sees every key of the tile), each row keeps only the keys
    in its [start, end).
    """
    in_page = pos % PAGE
    k = tl.load(
        k_ptr + (page * stride_kp + in_page * stride_ks + kvh * stride_kh)[:, None] + d[None, :],
        mask=kv_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        v_ptr + (page * stride_vp + in_page * stride_vs + kvh * stride_vh)[:, None] + dv[None, :],
        mask=kv_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * LOG2E  # scaling 1.0 (q_norm/k_norm replace 1/sqrt(d))
    if masked:
        visible = (pos[None, :] < end[:, None]) & (pos[None, :] >= start[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(round_to(p, v_ptr.dtype.element_ty), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _group_of_block(cu_ptr, num_groups, block, BLOCK_T: tl.constexpr):
    """The group owning flat query block `block`: group g's blocks are numbered from
    cu[g] // BLOCK_T + g on (at least ceil(rows / BLOCK_T) numbers per group, so the numbering needs
    no per-group sizes; a number past a group's last block is a program with no rows)."""
    count = 0
    for base in range(0, num_groups, 128):
        i = base + tl.arange(0, 128)
        ok = i < num_groups
        first = tl.load(cu_ptr + i, mask=ok, other=0) // BLOCK_T + i
        count += tl.sum((ok & (first <= block)).to(tl.int32))
    return count - 1


@triton.jit
def _attend_rows(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    token_seq_ptr,
    kv_end_ptr,
    table_ptr,
    row0,
    row_end,
    kvh,
    split,
    v0,
    window,
    num_q_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
    TABLE_CHUNK: tl.constexpr,
    CHUNK_TILES: tl.constexpr,
    LAUNCH_NEXT_LATE: tl.constexpr,
    PAGES_IN_REGISTERS: tl.constexpr,
    VALUE_DIM: tl.constexpr,
):
    """Query rows [row0, min(row0 + BLOCK_T, row_end)) of one group, all heads of KV head `kvh`,
    over this program's split of their keys, into value columns [v0, v0 + VALUE_DIM)."""
    # Rows of the dot: token-major, GROUP_P head slots per token (padding slots and tokens masked).
    offs_m = tl.arange(0, BLOCK_M)
    tok = row0 + offs_m // GROUP_P
    slot = offs_m % GROUP_P
    row_ok = (offs_m // GROUP_P < BLOCK_T) & (tok < row_end) & (slot < GROUP)
    tok = tl.where(row_ok, tok, row0).to(tl.int64)
    head = kvh * GROUP + tl.where(row_ok, slot, 0)
    end = tl.load(kv_end_ptr + tok)
    start = tl.where(window > 0, tl.maximum(end - window, 0), 0)
    hi = tl.max(tl.where(row_ok, end, 0), axis=0)
    lo = tl.min(tl.where(row_ok, start, hi), axis=0)

    # This program's share of the key blocks: absolute BLOCK_N-aligned tiles covering [lo, hi).
    # Tiles that start at lo are faster at batch 1 but slower at batch 32 (docs/performance.md).
    first = lo // BLOCK_N
    n_blocks = tl.cdiv(hi, BLOCK_N) - first
    per_split = tl.maximum(tl.cdiv(n_blocks, num_splits), MIN_BLOCKS)
    b_lo = first + split * per_split
    b_hi = tl.minimum(b_lo + per_split, first + n_blocks)
    table_row = table_ptr + tl.load(token_seq_ptr + row0).to(tl.int64) * stride_table
    # Few rows (latency-bound): the page numbers of the first CHUNK_TILES key tiles, in registers:
    # a K/V address then needs no table read in the loop, so the pipelined loads of the next tiles
    # issue at once instead of one table read (an L2 round trip) after another.
    # Entries outside the pages of [lo, hi) are not read (null or past the row).
    entries = tl.arange(0, TABLE_CHUNK)
    p_lo = lo // PAGE
    p_hi = tl.cdiv(hi, PAGE)
    if PAGES_IN_REGISTERS:
        p0 = b_lo * BLOCK_N // PAGE
        pages = tl.load(
            table_row + p0 + entries, mask=(p0 + entries >= p_lo) & (p0 + entries < p_hi), other=0
        )

    # All of the above reads metadata written before the step; q and the step's new keys come from
    # the kernel just before (the qkv epilogue), so wait for it only now.
    if LAUNCH_NEXT_LATE:
        if PDL:
            gdc_wait()
    else:
        wait_for_producer(PDL)
    d = tl.arange(0, HEAD_DIM)
    dv = v0 + tl.arange(0, VALUE_DIM)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, VALUE_DIM], tl.float32)
    if PAGES_IN_REGISTERS:
        for c_lo in range(b_lo, b_hi, CHUNK_TILES):
            # Most splits fit in one chunk; longer ones read the next chunk's pages while this one's
            # tiles run.
            c_hi = tl.minimum(c_lo + CHUNK_TILES, b_hi)
            p0 = c_lo * BLOCK_N // PAGE
            p_next = c_hi * BLOCK_N // PAGE
            p_stop = tl.where(c_hi < b_hi, p_hi, 0)  # (nothing after the last chunk)
            next_pages = tl.load(
                table_row + p_next + entries,
                mask=(p_next + entries >= p_lo) & (p_next + entries < p_stop),
                other=0,
            )
            for b in range(c_lo, c_hi):
                pos = b * BLOCK_N + tl.arange(0, BLOCK_N)
                kv_ok = (pos >= lo) & (pos < hi)
                # Each key's page from the entries in registers (page p0 on): no table read.
                rel = pos // PAGE - p0
                page = tl.sum(tl.where(rel[:, None] == entries[None, :], pages[None, :], 0), axis=1)
                m_i, l_i, acc = _attend_keys(
                    q,
                    k_ptr,
                    v_ptr,
                    m_i,
                    l_i,
                    acc,
                    pos,
                    kv_ok,
                    page.to(tl.int64),
                    True,
                    start,
                    end,
                    kvh,
                    d,
                    dv,
                    stride_kp,
                    stride_ks,
                    stride_kh,
                    stride_vp,
                    stride_vs,
                    stride_vh,
                    PAGE,
                    DOT_FP32,
                )
            pages = next_pages
    else:
        # Long query blocks are bound by the tiles' math, not by latency: each tile reads its pages
        # from the table (two cached entries), and tiles every row sees whole skip the score mask.
        whole_lo = tl.max(tl.where(row_ok, start, 0), axis=0)
        whole_hi = tl.min(tl.where(row_ok, end, hi), axis=0)
        for b in range(b_lo, b_hi):
            pos = b * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_ok = (pos >= lo) & (pos < hi)
            page = tl.load(table_row + pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
            masked = (b * BLOCK_N < whole_lo) | ((b + 1) * BLOCK_N > whole_hi)
            m_i, l_i, acc = _attend_keys(
                q,
                k_ptr,
                v_ptr,
                m_i,
                l_i,
                acc,
                pos,
                kv_ok,
                page,
                masked,
                start,
                end,
                kvh,
                d,
                dv,
                stride_kp,
                stride_ks,
                stride_kh,
                stride_vp,
                stride_vs,
                stride_vh,
                PAGE,
                DOT_FP32,
            )
    if LAUNCH_NEXT_LATE:
        if PDL:
            gdc_launch_dependents()

    has = l_i > 0.0  # a row with no visible key (never scheduled) yields zeros, not NaN
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if not SPLIT:
        o = o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        DT: tl.constexpr = o_ptr.dtype.element_ty
        tl.store(o, round_to(out, DT).to(DT), mask=row_ok[:, None])
    else:
        # Partials [T, num_q_heads, num_splits, (HEAD_DIM)]: every split writes its lse (-inf when
        # empty), the normalised output only where it saw a key; the merge reads outputs only where
        # lse is finite.
        part = (tok * num_q_heads + head) * num_splits + split
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        tl.store(
            part_o_ptr + part[:, None] * HEAD_DIM + dv[None, :], out, mask=(row_ok & has)[:, None]
        )


# Arguments that change from step to step are not specialised (Triton would compile a variant per
# value ==1 / divisible by 16, each a multi-second stall while serving): the window (the target's W,
# the drafter's W_a + 1), the split count, the group count, and the page-table width of an eager
# step.
@triton.jit(do_not_specialize=["window", "num_splits", "num_groups", "stride_table"])
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    token_seq_ptr,
    kv_end_ptr,
    table_ptr,
    cu_ptr,
    num_groups,
    window,
    num_q_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    TABLE_CHUNK: tl.constexpr,
    CHUNK_TILES: tl.constexpr,
    SHORT_T: tl.constexpr,
    SHORT_M: tl.constexpr,
    SHORT_N: tl.constexpr,
    SHORT_MIN_BLOCKS: tl.constexpr,
    SHORT_TABLE_CHUNK: tl.constexpr,
    SHORT_CHUNK_TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
    LAUNCH_NEXT_LATE: tl.constexpr,
    PREFILL: tl.constexpr,
    VALUE_PARTS: tl.constexpr,
):
    VALUE_DIM: tl.constexpr = HEAD_DIM // VALUE_PARTS
    value_part = 0
    if PREFILL:
        # One axis (no 65535 bound on the blocks), every head's programs of a query block before
        # the next block's, from the last block on: the prompt chunks (packed after the decoding
        # groups) start first and the short groups fill the GPU around them, instead of the
        # chunks' long programs starting last.
        heads_splits = (num_q_heads // GROUP) * num_splits * VALUE_PARTS
        kvh = tl.program_id(0) % heads_splits // (num_splits * VALUE_PARTS)
        split = tl.program_id(0) % (num_splits * VALUE_PARTS) // VALUE_PARTS
        value_part = tl.program_id(0) % VALUE_PARTS
        block = tl.num_programs(0) // heads_splits - 1 - tl.program_id(0) // heads_splits
        g = _group_of_block(cu_ptr, num_groups, block, BLOCK_T)
        first_row = tl.load(cu_ptr + g)
        row0 = first_row + (block - first_row // BLOCK_T - g) * BLOCK_T
    else:
        kvh = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        g = tl.program_id(0)
        first_row = tl.load(cu_ptr + g)
        row0 = first_row + tl.program_id(1) * BLOCK_T
    row_end = tl.load(cu_ptr + g + 1)
    if row0 >= row_end:
        return
    # In a prefill launch the groups of at most SHORT_T tokens (decodes, verifications, a prompt's
    # short tail) take the short tiles: on the chunks' 64-row tiles their few rows would cost the
    # MMA work of 64 (docs/performance.md).
    # fmt: off
    if PREFILL:
        if row_end - first_row > SHORT_T:
            _attend_rows(
                q_ptr, k_ptr, v_ptr, o_ptr, part_o_ptr, part_lse_ptr, token_seq_ptr, kv_end_ptr,
                table_ptr, row0, row_end, kvh, split, value_part * VALUE_DIM, window, num_q_heads,
                num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks,
                stride_kh, stride_vp, stride_vs, stride_vh, stride_table,
                GROUP, GROUP_P, HEAD_DIM, PAGE, BLOCK_T, BLOCK_M, BLOCK_N, SPLIT, MIN_BLOCKS,
                DOT_FP32, PDL, TABLE_CHUNK, CHUNK_TILES, LAUNCH_NEXT_LATE, False, VALUE_DIM,
            )
        elif value_part == 0:  # a short group's program computes every value column
            _attend_rows(
                q_ptr, k_ptr, v_ptr, o_ptr, part_o_ptr, part_lse_ptr, token_seq_ptr, kv_end_ptr,
                table_ptr, row0, row_end, kvh, split, 0, window, num_q_heads, num_splits,
                stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
                stride_vp, stride_vs, stride_vh, stride_table,
                GROUP, GROUP_P, HEAD_DIM, PAGE, SHORT_T, SHORT_M, SHORT_N, SPLIT,
                SHORT_MIN_BLOCKS, DOT_FP32, PDL, SHORT_TABLE_CHUNK, SHORT_CHUNK_TILES,
                LAUNCH_NEXT_LATE, True, HEAD_DIM,
            )
    else:
        _attend_rows(
            q_ptr, k_ptr, v_ptr, o_ptr, part_o_ptr, part_lse_ptr, token_seq_ptr, kv_end_ptr,
            table_ptr, row0, row_end, kvh, split, 0, window, num_q_heads, num_splits,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh,
            stride_vp, stride_vs, stride_vh, stride_table,
            GROUP, GROUP_P, HEAD_DIM, PAGE, BLOCK_T, BLOCK_M, BLOCK_N, SPLIT, MIN_BLOCKS,
            DOT_FP32, PDL, TABLE_CHUNK, CHUNK_TILES, LAUNCH_NEXT_LATE, True, HEAD_DIM,
        )
    # fmt: on


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    o_ptr,
    num_q_heads,
    num_splits,
    stride_ot,
    stride_oh,
    SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM)
    part = (t * num_q_heads + h) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    seen = lse > float("-inf")
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=seen[:, None], other=0.0)
    den = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    DT: tl.constexpr = o_ptr.dtype.element_ty
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, round_to(out, DT).to(DT))


def wide_rows(group: int) -> int:
    """Query rows of a 128-row prefill tile (its rows hold every head of the group)."""
    return max(1, 128 // next_pow2(group))


def attention_config(
    head_dim: int,
    group: int,
    max_q_len: int,
    tokens: int = 0,
    kv_heads: int = 1,
    chunk_context: int = 0,
) -> dict:
    """Tile shapes by head dim and phase, measured with bench/bench_kernels.py.

    The fp32 accumulator holds BLOCK_M x head_dim values, so in decode and verification wide heads
    get fewer rows per program; prefill chunks (more than 8 query rows) have their own tiles, and
    a launch of `tokens` query rows over `kv_heads` KV heads with programs enough for them, or
    (512-wide heads) whose chunks reach `chunk_context` positions of a long prefix, takes the
    128-row tiles. Stages count the key tiles in flight (the page numbers are in registers, so no
    table read is staged with them).
    """
    group_p = next_pow2(group)
    if max_q_len > 8:
        # Prefill / extend chunks (`bench_kernels.py --phases prefill --sweep`): 64 rows per
        # program and 32-key tiles; 8 warps only for the 512-wide tiles; 3 stages, which every
        # model's mixed-step launch runs faster on than 2 (`--phases mixed --sweep`).
        block_t = max(1, min(next_pow2(max_q_len), 64 // group_p))
        block_m = max(16, block_t * group_p)
        # Groups of a few rows beside the chunks (decodes, verifications): the fewest rows an MMA
        # takes, with the chunks' key tiles (the same shared memory).
        short_m = max(16, group_p)
        cfg = dict(
            block_t=block_t,
            block_m=block_m,
            block_n=32,
            short_block_t=short_m // group_p,
            short_block_m=short_m,
            short_block_n=32,
            num_warps=8 if block_m * head_dim > 16384 else 4,
            num_stages=3,
            value_parts=1,
        )
        # 128-row tiles read each key tile for twice the rows, and pay where the launch has
        # programs enough (WIDE_TILE_PROGRAMS): on the 256-wide heads with 64-key tiles; on the
        # 512-wide ones, whose 128-row accumulator would not fit in registers, with the value
        # columns split over two programs (each computes the scores again).
        wide_t = wide_rows(group)
        value_parts = 2 if head_dim > 256 else 1
        programs = cdiv(tokens, wide_t) * kv_heads * value_parts
        long_prefix = tokens >= LONG_PREFIX_TOKENS and chunk_context >= LONG_PREFIX
        enough = programs >= WIDE_TILE_PROGRAMS[value_parts]
        if max_q_len >= wide_t and (enough or (value_parts > 1 and long_prefix)):
            cfg.update(
                block_t=wide_t,
                block_m=wide_t * group_p,
                block_n=32 if value_parts > 1 else 64,
                num_warps=8,
                num_stages=2 if value_parts > 1 else 3,
                value_parts=value_parts,
            )
        return cfg
    max_rows = 64 if head_dim <= 256 else 32
    block_t = max(1, min(next_pow2(max_q_len), max_rows // group_p))
    block_m = max(16, block_t * group_p)
    return dict(
        block_t=block_t,
        block_m=block_m,
        block_n=64 if head_dim <= 256 else 32,
        # 8 warps for 64-row tiles of 256+ dims (the accumulator's registers); 512-wide tiles of
        # 16 or 32 rows are faster on 4 (docs/performance.md)
        num_warps=8 if block_m * head_dim >= 16384 and block_m >= 64 else 4,
        num_stages=2,
        value_parts=1,
    )


def split_limits(window: int, max_q_len: int) -> tuple[int, int]:
    """(most KV splits, fewest keys per split), from `bench/bench_kernels.py --sweep`.

    - Sliding layers: the queries see window + q - 1 keys, split in pieces of at most 128 keys
      (more splits only launch programs that find nothing and widen the merge). Decode splits the
      window in 64-key pieces; verification keeps 128 (64 was slower at batch 32).
    - Full layers decode fastest with short 32-key splits. Their verify tiles hold 4 tokens x 8
      heads of 512 dims, one program per SM, so at most 16 splits (one wave at batch 1).
    """
    if window > 0:
        return (
            (max(1, window // 64), 64)
            if max_q_len == 1
            else (cdiv(window + max_q_len - 1, 128), 128)
        )
    return (32, 32) if max_q_len == 1 else (16, 64)


def choose_splits(programs: int, sms: int, max_splits: int = MAX_SPLITS, waves: int = 2) -> int:
    """Enough KV splits for about `waves` waves of programs; 1 when the batch already fills them."""
    target = waves * sms
    if programs >= target:
        return 1
    return min(max_splits, next_pow2(cdiv(target, programs)))


def splits_within_waves(programs: int, sms: int, max_splits: int) -> int:
    """The most KV splits (up to max_splits) that keep the grid within 1.5 waves of the SMs.

    For sliding-window verification, whose tiles take an SM's shared memory alone: a grid a third
    of a wave past a whole one pays for the whole second wave (docs/performance.md).
    """
    return max(1, min(max_splits, 3 * sms // (2 * programs)))


@dataclass(frozen=True)
class AttentionLayer:
    """What a launch's tensors fix: heads, head width, page size, dtype, and its visible window."""

    head_dim: int
    num_heads: int
    kv_heads: int
    page_size: int
    window: int  # visible keys ending at kv_end (0 = unlimited)
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True)
class LaunchShape:
    """The host ints of a launch's metadata that choose its tiles, splits and grid."""

    tokens: int
    groups: int
    max_q_len: int
    chunk_context: int = 0  # the most positions any prefill chunk of the launch reaches


@dataclass(frozen=True)
class AttentionLaunch:
    """How one launch runs: its grid, its KV split count and the attention kernel's compile-time
    constants."""

    grid: tuple[int, ...]
    num_splits: int
    constants: dict

    @property
    def variant(self) -> tuple:
        """What Triton compiles an attention variant for (with the device's PDL)."""
        return tuple(sorted(self.constants.items()))


def merge_splits(
    part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, *, compile_only: bool = False
) -> None:
    """Merge the partials [T, nh, num_splits, (hd)] of a split launch into out [T, nh, hd]."""
    T, nh, num_splits, hd = part_o.shape
    _merge_kernel.run(
        part_o,
        part_lse,
        out,
        nh,
        num_splits,
        out.stride(0),
        out.stride(1),
        SPLITS_P=8 if num_splits <= 8 else next_pow2(num_splits),
        HEAD_DIM=hd,
        num_warps=4 if hd <= 256 else 8,
        **pdl_args(out.device),
        grid=(T, nh),
        warmup=compile_only,
    )


def plan_launch(
    layer: AttentionLayer,
    shape: LaunchShape,
    sms: int,
    *,
    num_splits: int | None = None,
    min_split_keys: int | None = None,
    config: dict | None = None,
) -> AttentionLaunch:
    """The tiles, split count and grid of a launch (host ints only); the overrides are
    `paged_attention`'s."""
    hd, nkv, window, page_size = layer.head_dim, layer.kv_heads, layer.window, layer.page_size
    T, G, max_q_len = shape.tokens, shape.groups, shape.max_q_len
    group = layer.num_heads // nkv
    # fp32 keeps the 64-row prefill tiles (the ieee FMA dot spills past them)
    cfg = attention_config(
        hd, group, max_q_len, 0 if layer.dtype == torch.float32 else T, nkv, shape.chunk_context
    )
    if config:  # a benchmark's explicit tiles
        cfg.update(config)
        if "block_m" not in config:
            cfg["block_m"] = max(16, cfg["block_t"] * next_pow2(group))
        if "short_block_t" in cfg:  # a short group fits one query block
            cfg["short_block_t"] = min(cfg["short_block_t"], cfg["block_t"])
            if "short_block_m" not in config:
                cfg["short_block_m"] = max(16, cfg["short_block_t"] * next_pow2(group))
    assert cfg["block_m"] >= cfg["block_t"] * next_pow2(group)
    assert cfg.get("short_block_m", 16) >= cfg.get("short_block_t", 0) * next_pow2(group)
    prefill = max_q_len > 8
    # Prefill: one flat axis of query blocks, T // block_t + G numbers (see _group_of_block).
    grid_blocks = (
        (T // cfg["block_t"] + G, 1) if prefill else (G, cdiv(max(1, max_q_len), cfg["block_t"]))
    )
    max_splits, default_min_keys = split_limits(window, max_q_len)
    min_split_keys = min_split_keys or default_min_keys
    if num_splits is None:
        programs = grid_blocks[0] * grid_blocks[1] * nkv
        if window > 0 and 1 < max_q_len <= 8:
            num_splits = splits_within_waves(programs, sms, max_splits)
        else:
            # Full-layer verification tiles (up to 32 rows of 512 dims, 4-8 warps) fill an SM
            # alone: a second wave of splits only adds partials to merge (docs/performance.md).
            waves = 1 if window == 0 and 1 < max_q_len <= 8 else 2
            num_splits = choose_splits(programs, sms, max_splits, waves)
    if not config:
        # Short decode splits want their few tiles in flight at once: a sliding split of at most 64
        # keys as 32-key tiles, all in flight; a full layer's 32-key split as two 16-key tiles,
        # deeper. Not for long full-layer splits, where it was slower. 8 warps for small sliding
        # grids win alone and lose inside a step (docs/performance.md).
        if window > 0 and max_q_len == 1 and cdiv(window, num_splits) <= 64:
            cfg.update(block_n=32, num_stages=3)
        if window == 0 and max_q_len == 1 and num_splits >= 16:
            cfg.update(block_n=16, num_stages=4)
        if layer.dtype == torch.float32 and not INTERPRET:
            # the fp32 (ieee FMA) dot spills at the bf16 tile sizes
            cfg.update(block_n=16, short_block_n=16, num_stages=1)
    entries, chunk = table_chunk(page_size, cfg["block_n"])
    # Decode and verification launches have no short groups: their short tiles repeat the main
    # ones (one compiled variant).
    short = {key: cfg.get(f"short_{key}", cfg[key]) for key in ("block_t", "block_m", "block_n")}
    short_entries, short_chunk = table_chunk(page_size, short["block_n"])
    value_parts = cfg["value_parts"]
    grid = (
        (grid_blocks[0] * nkv * num_splits * value_parts,)
        if prefill
        else (*grid_blocks, nkv * num_splits)
    )
    constants = dict(
        GROUP=group,
        GROUP_P=next_pow2(group),
        HEAD_DIM=hd,
        PAGE=page_size,
        BLOCK_T=cfg["block_t"],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        MIN_BLOCKS=max(1, cdiv(min_split_keys, cfg["block_n"])),
        TABLE_CHUNK=entries,
        CHUNK_TILES=chunk,
        SHORT_T=short["block_t"],
        SHORT_M=short["block_m"],
        SHORT_N=short["block_n"],
        SHORT_MIN_BLOCKS=max(1, cdiv(min_split_keys, short["block_n"])),
        SHORT_TABLE_CHUNK=short_entries,
        SHORT_CHUNK_TILES=short_chunk,
        SPLIT=num_splits > 1,
        DOT_FP32=dot_in_fp32(layer.dtype),
        # The next kernel (the merge, or o_proj) may launch once every program has passed its
        # wait. Single-query grids of at most two programs per SM let it launch only after their
        # key loops, which pays there and costs verification and larger decode grids
        # (docs/performance.md).
        LAUNCH_NEXT_LATE=max_q_len == 1 and G * nkv * num_splits <= 2 * sms,
        PREFILL=prefill,  # prefill chunks: the flat grid, the long groups' table-read key loop
        VALUE_PARTS=value_parts,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return AttentionLaunch(grid, num_splits, constants)


def paged_attention(
    q: torch.Tensor,  # [T, nh, hd]
    k_cache: torch.Tensor,  # [num_pages, page_size, nkv, hd]
    v_cache: torch.Tensor,
    token_seq: torch.Tensor,  # [T] int32
    kv_end: torch.Tensor,  # [T] int32
    page_table: torch.Tensor,  # [B, max_pages] int32
    cu_seqlens_q: torch.Tensor,  # [G+1] int32
    max_q_len: int,
    window: int,
    out: torch.Tensor | None = None,
    *,
    chunk_context: int = 0,
    num_splits: int | None = None,
    min_split_keys: int | None = None,
    config: dict | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """Attention of q [T, nh, hd] over the paged caches -> [T, nh, hd], into `out` when given.

    chunk_context: the most positions any prefill chunk of the launch reaches (a host int; it
    picks the tiles, so a captured launch keeps the context it was captured with).
    num_splits, min_split_keys and config override the tuned choices (benchmarks, tests).
    compile_only: compile the launch's kernels (queued under Triton's AsyncCompileMode) and run
    nothing.
    """
    T, nh, hd = q.shape
    page_size, nkv = k_cache.shape[1], k_cache.shape[2]
    assert nh % nkv == 0 and hd >= 16 and hd & (hd - 1) == 0, (
        "head_dim must be a power of two >= 16"
    )
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert page_table.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    G = cu_seqlens_q.shape[0] - 1
    if T == 0 or G == 0:
        return out
    launch = plan_launch(
        AttentionLayer(hd, nh, nkv, page_size, window, q.dtype),
        LaunchShape(T, G, max_q_len, chunk_context),
        sm_count(q.device),
        num_splits=num_splits,
        min_split_keys=min_split_keys,
        config=config,
    )
    num_splits = launch.num_splits
    if num_splits > 1:
        part_o = torch.empty(T, nh, num_splits, hd, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, nh, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # never touched
    _attn_kernel.run(
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_lse,
        token_seq,
        kv_end,
        page_table,
        cu_seqlens_q,
        G,
        int(window),
        nh,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        **launch.constants,
        **pdl_args(q.device),
        grid=launch.grid,
        warmup=compile_only,
    )
    if num_splits > 1:
        merge_splits(part_o, part_lse, out, compile_only=compile_only)
    return out
