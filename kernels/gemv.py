"""Skinny GEMM y = x @ W^T for the few-row steps (decode, verify, the draft loop), streaming W once.

At M <= 16 a step is a read of the weights, so the kernel is built around that read: a column tile
of W per program (narrow outputs also split K), the first K tile loaded *before* waiting on the
previous kernel. A fused [gate; up] weight can apply GELU·up in the epilogue (`glu=True`), each
program holding matching gate and up rows; any weight can end in GELU times another tensor
(`gelu_times`, PLE's gate). `gemv_mlp` chains that GEMV and the down projection
without a kernel boundary: down's K splits start on flags the gate_up tiles raise as they store.

Launched with programmatic dependent launch (PDL, Hopper), its programs start while the previous
kernel drains. Alone it is no faster than cuBLAS; it pays in the step because a chain of Triton
kernels keeps that overlap at every boundary, which a cuBLAS GEMM in between would end
(docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ._common import dot_in_fp32, next_pow2, pdl_args, round_to, sm_count, wait_for_producer
from .activation import gelu_times
from .all_reduce_norm import PeerBuffers, send_packets

MAX_ROWS = 16  # the dot's row tile; larger M goes to cuBLAS


@triton.jit
def _dot(x, w, DT: tl.constexpr, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(x.to(DT), tl.trans(w))


@triton.jit
def _in_split(row_ok, k0, kk, k_hi, EVEN_K: tl.constexpr):
    """Load mask of the K tile at k0: its rows, and its columns inside the split.

    When K is a multiple of the tile every tile is whole and the column mask is left out: a mask
    uniform along K keeps the loads vectorised.
    """
    if EVEN_K:
        return tl.broadcast_to(row_ok, [row_ok.shape[0], kk.shape[0]])
    return row_ok & (k0 + kk < k_hi)[None, :]


@triton.jit
def _await_columns(flag_ptr, split, k_lo, k_hi, cols_per_signal, PDL: tl.constexpr):
    """Dataflow wait of a K-split consumer (down after gate_up).

    Spins until every producer tile writing x[:, k_lo:k_hi] has signalled its flag, instead of
    waiting for the whole producer kernel to end. Then this program counts itself in; the split's
    last consumer re-arms the flag (zero) for the next launch and graph replay.
    """
    need = tl.cdiv(k_hi - k_lo, cols_per_signal)
    while tl.atomic_add(flag_ptr + split, 0, sem="acquire") < need:
        pass
    if PDL:
        gdc_launch_dependents()
    if tl.atomic_add(flag_ptr + split, 1, sem="relaxed") == need + tl.num_programs(0) - 1:
        tl.atomic_xchg(flag_ptr + split, 0, sem="relaxed")


@triton.jit
def _output_tile(acc, times_ptr, m, n, ok, stride_tm, DT: tl.constexpr, GELU_TIMES: tl.constexpr):
    """The fp32 sums as stored: as they are, or gelu_tanh(sums) * times with the rounding points of
    those torch ops on DT tensors."""
    if not GELU_TIMES:
        return acc
    times = tl.load(times_ptr + m[:, None] * stride_tm + n[None, :], mask=ok, other=0.0)
    return gelu_times(round_to(acc, DT), times.to(tl.float32), DT)


@triton.jit
def _store_tile(
    y,
    out,
    ok,
    m,
    first_col,
    M,
    N,
    buffers_ptr,
    epoch_ptr,
    source_packets,
    DT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PUSH: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
):
    """Store a finished output tile (fp32 sums [BM, BN] from an even column) as DT. PUSH also
    sends it to every peer as the next fused all-reduce's packets, laid out as that kernel sends
    them (kernels/all_reduce_norm.py), so that it only waits for them."""
    if PUSH:
        y = round_to(y, DT)  # the packets carry exactly the stored values
    tl.store(out, y.to(DT), mask=ok)
    if PUSH:
        # The all-reduce before this one advanced it (every kernel before this one's predecessor
        # has finished: `wait_for_producer`); read past L1, without an atomic per program.
        epoch = tl.load(epoch_ptr, volatile=True)
        bits = (y.to(tl.uint32, bitcast=True) >> 16).to(tl.int64)  # each value's bf16 bits
        low, high = tl.split(tl.reshape(bits, [BM, BN // 2, 2]))
        packets = (epoch << 32) | (high << 16) | low
        pair = first_col // 2 + tl.arange(0, BN // 2)
        pair_ok = (m < M)[:, None] & (pair < N // 2)[None, :]
        send_packets(
            buffers_ptr, epoch & 1, source_packets, m[:, None] * (N // 2), pair[None, :], packets,
            pair_ok, RANK, WORLD,
        )  # fmt: skip


@triton.jit(do_not_specialize=["k_per_split", "flag_cols"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    times_ptr,
    part_ptr,
    count_ptr,
    flag_ptr,
    push_buffers_ptr,
    push_epoch_ptr,
    push_source_packets,
    M,
    N,
    K,
    k_per_split,
    flag_cols,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_tm,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    DOT_FP32: tl.constexpr,
    GLU: tl.constexpr,
    SIGNAL: tl.constexpr,
    AWAIT: tl.constexpr,
    GELU_TIMES: tl.constexpr,
    PUSH: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
):
    """y = x @ w^T over one column tile and K split per program.

    SIGNAL (a GLU producer): after storing its tile, add one to flag[first column // flag_cols].
    AWAIT (a K-split consumer of that output): wait on flag[split] for flag_cols-column producer
    tiles instead of on the producer kernel, and read x past L1 (its lines are written while this
    kernel runs).
    PUSH (a row-parallel projection under tensor parallelism, bf16): also send each finished tile
    to the peers as the fused all-reduce's packets (`_store_tile`).
    """
    tile = tl.program_id(0)
    split = tl.program_id(1)
    if GLU:
        # W is [gate; up] ([2N, K]): the program's BN rows are BN/2 gate rows and the matching up
        # rows, so its output tile is gelu(gate) * up over BN/2 columns (the activation kernel's
        # rounding points).
        HALF: tl.constexpr = BN // 2
        j = tl.arange(0, BN)
        col = tile * HALF + j % HALF
        n = col + (j // HALF) * N
        n_ok = (col < N)[:, None]
    else:
        n = tile * BN + tl.arange(0, BN)
        n_ok = (n < N)[:, None]
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    m_ok = (m < M)[:, None]
    DT: tl.constexpr = y_ptr.dtype.element_ty
    # k_per_split is a multiple of BK; the hint keeps the loads 16 bytes wide (the split offset is
    # not specialised, so the compiler cannot prove its alignment itself).
    k_lo = tl.multiple_of(split * k_per_split, BK)
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :]
    x_ptrs = x_ptr + m[:, None] * stride_xm + kk[None, :]
    # Weights never depend on the previous kernel: start reading them before waiting for it.
    w = tl.load(
        w_ptrs + k_lo,
        mask=_in_split(n_ok, k_lo, kk, k_hi, EVEN_K),
        other=0.0,
        eviction_policy="evict_first",
    )
    if AWAIT:
        _await_columns(flag_ptr, split, k_lo, k_hi, flag_cols, PDL)
    else:
        wait_for_producer(PDL)
    X_CACHE: tl.constexpr = ".cg" if AWAIT else ""
    x = tl.load(
        x_ptrs + k_lo,
        mask=_in_split(m_ok, k_lo, kk, k_hi, EVEN_K),
        other=0.0,
        cache_modifier=X_CACHE,
    )
    acc = _dot(x, w, DT, DOT_FP32)
    for k0 in range(k_lo + BK, k_hi, BK):
        k0 = tl.multiple_of(k0, BK)
        w = tl.load(
            w_ptrs + k0,
            mask=_in_split(n_ok, k0, kk, k_hi, EVEN_K),
            other=0.0,
            eviction_policy="evict_first",
        )
        x = tl.load(
            x_ptrs + k0,
            mask=_in_split(m_ok, k0, kk, k_hi, EVEN_K),
            other=0.0,
            cache_modifier=X_CACHE,
        )
        acc += _dot(x, w, DT, DOT_FP32)
    if GLU:
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BM, 2, HALF]), (0, 2, 1)))
        col = tile * HALF + tl.arange(0, HALF)
        y = gelu_times(round_to(gate, DT), round_to(up, DT), DT)
        tl.store(
            y_ptr + m[:, None] * stride_ym + col[None, :], y.to(DT), mask=m_ok & (col < N)[None, :]
        )
        if SIGNAL:
            tl.debug_barrier()  # every thread's store is issued before the release below
            tl.atomic_add(flag_ptr + tile * HALF // flag_cols, 1, sem="release")
        return
    out = y_ptr + m[:, None] * stride_ym + n[None, :]
    out_ok = m_ok & (n < N)[None, :]
    if SPLIT == 1:
        y = _output_tile(acc, times_ptr, m, n, out_ok, stride_tm, DT, GELU_TIMES)
        _store_tile(
            y, out, out_ok, m, tile * BN, M, N, push_buffers_ptr, push_epoch_ptr,
            push_source_packets, DT, BM, BN, PUSH, RANK, WORLD,
        )  # fmt: skip
    else:
        # Split-K: each split leaves its fp32 partial [BM, BN]; the split that finishes last for
        # this tile sums them in split order (deterministic) and writes the output, so no second
        # kernel is needed.
        part = part_ptr + (split * BM + m[:, None]) * N + n[None, :]
        tl.store(part, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros([BM, BN], tl.float32)
            for s in range(SPLIT):
                total += tl.load(
                    part_ptr + (s * BM + m[:, None]) * N + n[None, :],
                    mask=out_ok,
                    other=0.0,
                    cache_modifier=".cg",
                )
            y = _output_tile(total, times_ptr, m, n, out_ok, stride_tm, DT, GELU_TIMES)
            _store_tile(
                y, out, out_ok, m, tile * BN, M, N, push_buffers_ptr, push_epoch_ptr,
                push_source_packets, DT, BM, BN, PUSH, RANK, WORLD,
            )  # fmt: skip
            tl.store(count_ptr + tile, 0)  # re-armed for the next launch (and graph replay)


_scratch: dict[torch.device, torch.Tensor] = {}


def _zeroed_scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(arrival counters of the split-K tiles, dataflow flags of gemv_mlp), zero between launches.

    The last split of a tile resets its counter, the last consumer of a flag resets the flag. One
    buffer serves every launch on the device: kernels of a stream use it one after another.
    """
    if device not in _scratch:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        assert not capturing, "run gemv once before capturing a CUDA graph"
        _scratch[device] = torch.zeros(2, 1024, dtype=torch.int32, device=device)
    return _scratch[device][0], _scratch[device][1]


def splits_for(tiles: int, K: int, device: torch.device) -> int:
    """K splits that give each SM about two programs when `tiles` column tiles alone would not fill
    the GPU, each split at least two 256-wide K tiles long."""
    sms = sm_count(device)
    return 1 if tiles >= sms else max(1, min(next_pow2(triton.cdiv(2 * sms, tiles)), K // 512))


def gemv_config(N: int, K: int, device: torch.device, glu: bool = False) -> tuple:
    """(BN, BK, num_warps, num_stages, K splits) by shape, from bench/bench_gemv.py's sweeps.

    - Wide outputs (N >= 16384): 64-column tiles when those fill at most two waves of the SMs (the
      sliding qkv) or carry the GLU epilogue (gate_up); else 32-column tiles with two warps (the
      full layers' qkv, the LM heads).
    - Narrow outputs: 32-column tiles with two warps, split along K when those tiles alone would
      not fill the GPU (the drafter's 1024-wide projections) or K is long (two splits for the full
      layers' o_proj, K = 16384).
    """
    sms = sm_count(device)
    if N >= 16384:
        return (64, 256, 4, 3, 1) if glu or N // 64 <= 2 * sms else (32, 256, 2, 4, 1)
    if K >= 16384:
        return 32, 256, 2, 4, 2
    tiles = triton.cdiv(N, 32)
    return 32, 256, 2, (4 if tiles >= sms else 3), splits_for(tiles, K, device)


def mlp_down_config(N: int, K: int, device: torch.device) -> tuple | None:
    """gemv_mlp's down projection, split along K (it awaits the splits one by one).

    None where chaining does not pay, and gemv_mlp runs the two GEMVs instead: where down's column
    tiles alone do not fill the SMs (narrow MLPs such as the drafter's) or K is short
    (bench/bench_gemv.py; the 31B's MLP chains on one GPU and on each rank of two). A rank's K
    (10752) runs faster in 12 splits (11 of 1024 columns) than in the 7 of K = 21504
    (docs/performance.md).
    """
    if triton.cdiv(N, 32) < sm_count(device) or K < 8192:
        return None
    return (32, 256, 4, 3, 7) if K >= 16384 else (32, 256, 4, 3, 12)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    config: tuple | None = None,
    glu: bool = False,
    gelu_times: torch.Tensor | None = None,
    push: PeerBuffers | None = None,
) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] for M <= MAX_ROWS.

    glu: w is a fused [gate; up] projection and the result is gelu_tanh(gate) * up, [M, N / 2].
    gelu_times [M, N]: the result is gelu_tanh(x @ w^T) * gelu_times.
    push: a row-parallel projection's peers: the result also goes to them as the packets of the
    fused all-reduce that follows (`all_reduce_residual_norm(..., pushed=True)`).
    `config` overrides gemv_config (benchmarks, tests).
    """
    M, K = x.shape
    N = w.shape[0]
    _check(x, w)
    assert gelu_times is None or (
        not glu and gelu_times.shape == (M, N) and gelu_times.stride(1) == 1
    )
    y = torch.empty(M, N // 2 if glu else N, dtype=x.dtype, device=x.device)
    _launch_columns(
        x,
        w,
        y,
        config or gemv_config(N, K, x.device, glu),
        glu=glu,
        gelu_times=gelu_times,
        push=push,
    )
    return y


def gemv_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    config: tuple | None = None,
    push: PeerBuffers | None = None,
) -> torch.Tensor:
    """down(gelu_tanh(x @ gate^T) * (x @ up^T)) for M <= MAX_ROWS, no kernel boundary between the
    two GEMVs.

    down runs split along K, and each of its splits starts as soon as the gate_up tiles that write
    its K range have stored (they count themselves in on a flag per range), not when all of gate_up
    has ended. Launched under PDL, down's programs take the SMs that gate_up's last wave leaves
    idle. `config` overrides down's mlp_down_config; `push` as gemv's, for down.
    """
    M, H = x.shape
    N, inter = down.shape
    _check(x, gate_up)
    assert gate_up.shape[0] == 2 * inter and N == H and down.stride(1) == 1
    down_cfg = config or mlp_down_config(N, inter, x.device)
    if down_cfg is None:
        return gemv(gemv(x, gate_up, glu=True), down, push=push)
    up_cfg = gemv_config(2 * inter, H, x.device, glu=True)
    act = torch.empty(M, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    k_per_split, splits = _k_splits(inter, down_cfg[1], down_cfg[4])
    _, flags = _zeroed_scratch(x.device)
    assert splits <= len(flags) and k_per_split % (up_cfg[0] // 2) == 0
    _launch_columns(
        x, gate_up, act, up_cfg, glu=True, flags=flags, flag_cols=k_per_split, signal=True
    )
    _launch_columns(
        act,
        down,
        y,
        down_cfg,
        flags=flags,
        flag_cols=up_cfg[0] // 2,
        wait_on_flags=True,
        push=push,
    )
    return y


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    assert (
        x.shape[0] <= MAX_ROWS
        and w.shape[1] == x.shape[1]
        and x.stride(1) == 1
        and w.stride(1) == 1
    )


def _k_splits(K: int, bk: int, split: int) -> tuple[int, int]:
    """(K per split, a multiple of the K tile; splits), with no empty split (its first tile would
    be read unmasked)."""
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    return k_per_split, triton.cdiv(K, k_per_split)


def _launch_columns(
    x,
    w,
    y,
    config: tuple,
    glu: bool = False,
    flags=None,
    flag_cols: int = 0,
    signal: bool = False,
    wait_on_flags: bool = False,
    gelu_times: torch.Tensor | None = None,
    push: PeerBuffers | None = None,
) -> None:
    """_gemv_kernel over column tiles of w (and K splits): y = x @ w^T, gelu_tanh(y) * gelu_times,
    or the GLU epilogue's [M, N / 2]; sent to `push`'s peers too."""
    M, K = x.shape
    N = w.shape[0]
    assert push is None or (not glu and push.fits(y)), "pushed rows are whole bf16 outputs"
    bn, bk, warps, stages, split = config
    if glu:
        assert N % 2 == 0
        N, split = N // 2, 1  # the activation needs whole sums: no K split
        tiles = triton.cdiv(N, bn // 2)
    else:
        tiles = triton.cdiv(N, bn)
    k_per_split, split = _k_splits(K, bk, split)
    if split > 1:
        counters, _ = _zeroed_scratch(x.device)
        assert tiles <= len(counters)
        part = torch.empty(split, MAX_ROWS, N, dtype=torch.float32, device=x.device)
    else:
        part = counters = y  # never touched
    _gemv_kernel[(tiles, split)](
        x,
        w,
        y,
        gelu_times if gelu_times is not None else y,
        part,
        counters,
        flags if flags is not None else y,
        push.buffers if push is not None else y,
        push.epoch if push is not None else y,
        push.source_packets if push is not None else 0,
        M,
        N,
        K,
        k_per_split,
        flag_cols,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        0 if gelu_times is None else gelu_times.stride(0),
        BM=MAX_ROWS,
        BN=bn,
        BK=bk,
        SPLIT=split,
        EVEN_K=K % bk == 0,
        DOT_FP32=dot_in_fp32(x.dtype),
        GLU=glu,
        SIGNAL=signal,
        AWAIT=wait_on_flags,
        GELU_TIMES=gelu_times is not None,
        PUSH=push is not None,
        RANK=push.rank if push is not None else 0,
        WORLD=push.world if push is not None else 1,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x.device),
    )
