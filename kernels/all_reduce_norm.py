"""The sum over tensor-parallel ranks of a row-parallel projection's partial rows, then the residual
add and norms of rmsnorm_residual_add, in one kernel (decode, verify and draft-loop sizes).

Every rank pushes its partial rows into every peer's receive buffer (NVLink stores to peer memory
the caller mapped), waits for every peer's rows in its own buffer and sums all ranks' rows in rank
order, so every rank gets the same sum. Two launches (an all-reduce kernel, then the norm kernel)
become one, which chains to its neighbours under PDL.

The rows travel as 8-byte packets, two bf16 values in the low half and the call's epoch in the
high half (NCCL's LL protocol): an aligned 8-byte store lands whole, so a packet that shows this
call's epoch holds this call's data, and no fence or separate flag has to cross NVLink first.

Every rank advances its epoch once per call. The ranks launch the same kernels in the same
order, so their epochs agree without host input and CUDA graphs replay them. Buffers alternate
by epoch parity: a rank reaches call e + 2 only after it received every peer's rows of call e + 1,
which a peer sends only after its call e finished (its PDL wait), so no row is overwritten before
it is read.

The GEMV that produces the rows can send them itself, tile by tile as it stores them
(`gemv(..., push=peers)`, then this kernel with `pushed=True`): the packets cross while the GEMV's
last tiles run and this kernel's launch drains. The order above still holds: that GEMV starts only
after every kernel before its predecessor has finished, this rank's call e among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl_args, round_to, row_warps
from .norm import norm_weights, residual_norm_row

# A packet's high half: the epoch's low 32 bits (0xFFFFFFFF00000000 as int64).
EPOCH_BITS = tl.constexpr(-(2**32))


@dataclass(frozen=True)
class PeerBuffers:
    """Where the ranks exchange partial rows: memory every rank can address (the caller maps it,
    e.g. torch's symmetric memory, zeroed), plus this rank's epoch."""

    rank: int
    world: int
    buffers: torch.Tensor  # int64 [world]: each rank's receive buffer, 2 * world * source_packets
    epoch: torch.Tensor  # int64 [2] on this rank: (the next call's epoch, programs done), [1, 0]
    source_packets: int  # 8-byte packets (two values each) of one (parity, source rank) region
    max_programs: int  # the largest grid

    def fits(self, h: torch.Tensor) -> bool:
        """bf16 rows of an even width that fit a source region; decided by shape alone, so every
        rank takes the same path for the same call."""
        return (
            h.dim() == 2
            and h.dtype == torch.bfloat16
            and h.shape[1] % 2 == 0
            and h.numel() <= 2 * self.source_packets
        )


@triton.jit
def _unpack(pairs, BLOCK: tl.constexpr):
    """fp32 [BLOCK] of bf16 pairs held in the low 32 bits of [BLOCK // 2] integers (little
    endian: element 2i in the low 16 bits)."""
    low = ((pairs & 0xFFFF) << 16).to(tl.uint32).to(tl.float32, bitcast=True)
    high = (((pairs >> 16) & 0xFFFF) << 16).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(low, high), [BLOCK])


@triton.jit
def send_packets(buffers_ptr, parity, source_packets, row_start, pair, packets, mask, RANK, WORLD):
    """Store `packets` (pairs `pair` of the rows starting at packet `row_start`) in this rank's
    region (parity, RANK) of every peer's receive buffer: the one layout this kernel and a pushing
    GEMV (kernels/gemv.py) send in."""
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            buffer = tl.load(buffers_ptr + peer).to(tl.pointer_type(tl.int64))
            region = buffer + (parity * WORLD + RANK) * source_packets
            tl.store(region + row_start + pair, packets, mask=mask)


@triton.jit
def _all_reduce_norm_kernel(
    h_ptr,
    x_ptr,
    w_ptr,
    s_ptr,
    w2_ptr,
    o_ptr,
    o2_ptr,
    buffers_ptr,
    epoch_ptr,
    rows,
    n,
    source_packets,
    stride_h,
    stride_x,
    stride_o,
    stride_o2,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_SCALAR: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    PUSHED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    pair = tl.arange(0, BLOCK // 2)  # packet i carries elements 2i and 2i + 1
    pair_mask = pair < n // 2
    w, scalar, w2 = norm_weights(w_ptr, s_ptr, w2_ptr, offs, mask, HAS_SCALAR, HAS_NEXT)
    # Read before the wait: the previous call advanced the epoch before it let its successor
    # launch (below), so no kernel after it can see the old one.
    epoch = tl.atomic_add(epoch_ptr, 0, sem="relaxed")
    parity = epoch & 1
    stamp = epoch << 32  # this call's packets' high half
    if PDL:
        gdc_wait()
    # The last program to read the epoch advances it, then every program lets the next kernel
    # launch (it prefetches its weights while this one exchanges rows).
    if tl.atomic_add(epoch_ptr + 1, 1, sem="acq_rel") == programs - 1:
        tl.atomic_xchg(epoch_ptr + 1, 0, sem="relaxed")
        tl.atomic_xchg(epoch_ptr, epoch + 1, sem="release")
    if PDL:
        gdc_launch_dependents()
    h_pairs = h_ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    # Source s's rows sit at region (parity, s) of every receive buffer (PUSHED: the GEMV that
    # wrote h sent them as it stored them).
    if not PUSHED:
        for row in range(program, rows, programs):
            pairs = tl.load(h_pairs + row * (stride_h // 2) + pair, mask=pair_mask)
            packets = stamp | (pairs.to(tl.int64) & 0xFFFFFFFF)
            send_packets(
                buffers_ptr, parity, source_packets, row * (n // 2), pair, packets, pair_mask,
                RANK, WORLD,
            )  # fmt: skip
    own = tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.int64))
    for row in range(program, rows, programs):
        # Every load that needs no peer is issued before the spins, so that none waits after them.
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        own_pairs = tl.load(h_pairs + row * (stride_h // 2) + pair, mask=pair_mask, other=0)
        total = tl.zeros([BLOCK], tl.float32)
        for source in tl.static_range(WORLD):  # summed in rank order on every rank
            if source == RANK:
                pairs = own_pairs
            else:
                region = own + (parity * WORLD + source) * source_packets + row * (n // 2)
                pairs = tl.load(region + pair, mask=pair_mask, other=stamp, volatile=True)
                while tl.min(((pairs & EPOCH_BITS) == stamp).to(tl.int32), axis=0) == 0:
                    pairs = tl.load(region + pair, mask=pair_mask, other=stamp, volatile=True)
            total += _unpack(pairs, BLOCK)
        h = round_to(total, tl.bfloat16)  # the all-reduced tensor's dtype, as an all-reduce gives
        o_row, o2_row = o_ptr + row * stride_o, o2_ptr + row * stride_o2
        residual_norm_row(
            x, h, w, scalar, w2, o_row, o2_row, offs, mask, n, eps, HAS_SCALAR, HAS_NEXT
        )


def all_reduce_residual_norm(
    x: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    layer_scalar: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    peers: PeerBuffers,
    pushed: bool = False,
):
    """rmsnorm_residual_add(x, sum over ranks of h, ...) for h [T, n] with peers.fits(h), as one
    collective launch (every rank calls it with the same shapes). `pushed`: the GEMV that wrote h
    already sent it to the peers (`gemv(..., push=peers)`)."""
    assert x.shape == h.shape and x.dtype == h.dtype and peers.fits(h) and x.stride(1) == 1
    rows, n = h.shape
    if h.stride(1) != 1 or h.stride(0) % 2 or h.data_ptr() % 4:  # read as 4-byte pairs
        h = h.clone(memory_format=torch.contiguous_format)
    out = torch.empty_like(x)
    out2 = torch.empty_like(out) if next_weight is not None else out
    if rows:
        block = next_pow2(n)
        _all_reduce_norm_kernel[(min(rows, peers.max_programs),)](
            h,
            x,
            weight,
            layer_scalar if layer_scalar is not None else weight,
            next_weight if next_weight is not None else weight,
            out,
            out2,
            peers.buffers,
            peers.epoch,
            rows,
            n,
            peers.source_packets,
            h.stride(0),
            x.stride(0),
            out.stride(0),
            out2.stride(0),
            eps,
            RANK=peers.rank,
            WORLD=peers.world,
            HAS_SCALAR=layer_scalar is not None,
            HAS_NEXT=next_weight is not None,
            PUSHED=pushed,
            BLOCK=block,
            num_warps=row_warps(block),
            **pdl_args(x.device),
        )
    return (out, out2) if next_weight is not None else (out, None)
