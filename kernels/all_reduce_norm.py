"""The sum over tensor-parallel ranks of a row-parallel projection's partial rows, then the residual
add and norms of rmsnorm_residual_add, in one kernel (decode, verify and draft-loop sizes).

Every rank pushes its partial rows into every rank's receive buffer (NVLink stores to peer memory
the caller mapped), raises a flag there, waits for every rank's flag and sums the ranks' rows in
rank order from its own buffer, so every rank gets the same sum. Two launches (an all-reduce
kernel, then the norm kernel) become one, which chains to its neighbours under PDL.

The flags carry an epoch that every rank advances once per call. The ranks launch the same
kernels in the same order, so their epochs agree without host input and CUDA graphs replay them.
Buffers and flags alternate by epoch parity: a rank reaches call e + 2 only after every peer
raised its flag of call e + 1, which a peer does only after call e finished (its PDL wait).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import next_pow2, pdl_args, round_to, row_warps
from .norm import norm_weights, residual_norm_row


@dataclass(frozen=True)
class PeerBuffers:
    """Where the ranks exchange partial rows: memory every rank can address (the caller maps it,
    e.g. torch's symmetric memory), plus this rank's epoch."""

    rank: int
    world: int
    buffers: torch.Tensor  # int64 [world]: each rank's receive buffer, 2 * world * source_elements
    flags: torch.Tensor  # int64 [world]: each rank's int64 flags, 2 * max_programs * world, zeroed
    epoch: torch.Tensor  # int64 [2] on this rank: (the next call's epoch, programs done), [1, 0]
    source_elements: int  # 2-byte elements of one (parity, source rank) region
    max_programs: int  # the same on every rank (flags exist for this many programs)

    def fits(self, h: torch.Tensor) -> bool:
        """Rows of a 2-byte dtype that fit a source region; decided by shape alone, so every rank
        takes the same path for the same call."""
        return h.dim() == 2 and h.element_size() == 2 and h.numel() <= self.source_elements


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
    flags_ptr,
    epoch_ptr,
    rank,
    rows,
    n,
    source_elements,
    max_programs,
    stride_h,
    stride_x,
    stride_o,
    stride_o2,
    eps,
    WORLD: tl.constexpr,
    HAS_SCALAR: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    DT: tl.constexpr = o_ptr.dtype.element_ty
    w, scalar, w2 = norm_weights(w_ptr, s_ptr, w2_ptr, offs, mask, HAS_SCALAR, HAS_NEXT)
    # Read before the wait: the previous call advanced the epoch before it let its successor
    # launch (below), so no kernel after it can see the old one.
    epoch = tl.atomic_add(epoch_ptr, 0, sem="relaxed")
    parity = epoch & 1
    # This program's rows of source s sit at region (parity, s) of every receive buffer.
    region = (parity * WORLD + rank) * source_elements
    flag = (parity * max_programs + program) * WORLD
    if PDL:
        gdc_wait()
    # The last program to read the epoch advances it, then every program lets the next kernel
    # launch (it prefetches its weights while this one exchanges rows).
    if tl.atomic_add(epoch_ptr + 1, 1, sem="acq_rel") == programs - 1:
        tl.atomic_xchg(epoch_ptr + 1, 0, sem="relaxed")
        tl.atomic_xchg(epoch_ptr, epoch + 1, sem="release")
    if PDL:
        gdc_launch_dependents()
    for row in range(program, rows, programs):
        h = tl.load(h_ptr + row * stride_h + offs, mask=mask)
        for peer in tl.static_range(WORLD):
            buffer = tl.load(buffers_ptr + peer).to(tl.pointer_type(DT))
            tl.store(buffer + region + row * n + offs, h, mask=mask)
    tl.debug_barrier()  # every thread's stores are issued before the releases below
    for peer in tl.static_range(WORLD):
        flags = tl.load(flags_ptr + peer).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(flags + flag + rank, epoch, sem="release", scope="sys")
    own_flags = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int64))
    for source in tl.static_range(WORLD):
        while tl.atomic_add(own_flags + flag + source, 0, sem="acquire", scope="sys") != epoch:
            pass
    tl.debug_barrier()  # no thread reads the buffer before every flag is seen
    own = tl.load(buffers_ptr + rank).to(tl.pointer_type(DT)) + parity * WORLD * source_elements
    for row in range(program, rows, programs):
        total = tl.zeros([BLOCK], tl.float32)
        for source in tl.static_range(WORLD):
            part = own + source * source_elements + row * n + offs
            total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        h = round_to(total, DT)  # the all-reduced tensor's dtype, as an all-reduce gives
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
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
):
    """rmsnorm_residual_add(x, sum over ranks of h, ...) for h [T, n] with peers.fits(h), as one
    collective launch (every rank calls it with the same shapes)."""
    assert x.shape == h.shape and x.dtype == h.dtype and peers.fits(h) and x.stride(1) == 1
    rows, n = h.shape
    h = h if h.stride(1) == 1 else h.contiguous()
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
            peers.flags,
            peers.epoch,
            peers.rank,
            rows,
            n,
            peers.source_elements,
            peers.max_programs,
            h.stride(0),
            x.stride(0),
            out.stride(0),
            out2.stride(0),
            eps,
            WORLD=peers.world,
            HAS_SCALAR=layer_scalar is not None,
            HAS_NEXT=next_weight is not None,
            BLOCK=block,
            num_warps=row_warps(block),
            **pdl_args(x.device),
        )
    return (out, out2) if next_weight is not None else (out, None)
