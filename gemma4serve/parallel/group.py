"""The tensor-parallel group a rank's model runs its collectives over, passed explicitly.

Modules hold `tp: TensorParallel | None`; None (one device) runs no collective and never touches
torch.distributed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gemma4serve.model.layers import BestTokens

if TYPE_CHECKING:
    from gemma4serve_kernels import PeerBuffers

log = logging.getLogger("gemma4serve")

# torch 2.13 renamed all_gather_into_tensor (older releases have only that name).
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OneShotAllReduce:
    """Small bf16 all-reduces through symmetric memory: one kernel copies the input into this
    rank's staging buffer, waits for every rank, and sums the buffers read over NVLink P2P (no
    multicast). At a decode step's sizes it takes well under NCCL's ring latency
    (docs/performance.md)."""

    MAX_BYTES = 8 * 2**20  # larger messages (prefill chunks) go through NCCL

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        import torch.distributed._symmetric_memory as symmetric_memory

        self.group_name = group.group_name
        self.buffer = symmetric_memory.empty(
            self.MAX_BYTES // 2, dtype=torch.bfloat16, device=device
        )
        symmetric_memory.rendezvous(self.buffer, self.group_name)

    @classmethod
    def create(cls, group: dist.ProcessGroup, device: torch.device) -> OneShotAllReduce | None:
        """The staging buffer on every rank (a collective), or None where symmetric memory does
        not run (NCCL serves every all-reduce then)."""
        try:
            return cls(group, device)
        except Exception as e:  # noqa: BLE001 - any failure leaves NCCL, which always works
            log.warning("custom all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
            return None

    def fits(self, x: torch.Tensor) -> bool:
        """bf16 within the buffer, in 16-byte units: decided by shape alone, so every rank takes
        the same path for the same all-reduce."""
        nbytes = x.numel() * x.element_size()
        return x.dtype == torch.bfloat16 and nbytes <= self.MAX_BYTES and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (every rank adds the buffers in rank order: the ranks get identical
        sums); in place where x is contiguous and 16-byte aligned, as fresh tensors are."""
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous().clone()
        flat = x.view(-1)
        staging = self.buffer[: flat.numel()]
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, flat, "sum", self.group_name, flat)
        return x


class FusedAllReduceNorm:
    """A row-parallel output's all-reduce and the residual norm after it as one kernel
    (kernels/all_reduce_norm.py) over symmetric memory: each rank pushes its rows into every
    peer's buffer over NVLink P2P (no multicast). For decode, verify and draft-loop rows."""

    # Rows times peers it takes: past that, one-shot then the norm kernel is faster (TP = 4 at 160
    # rows; TP = 2 still gains at 160: docs/performance.md).
    MAX_PEER_ROWS = 160
    # 8-byte packets (two bf16 each) per (parity, source rank): 195 rows of the 31B's 5376.
    SOURCE_PACKETS = 2**19

    def __init__(self, tp: TensorParallel, device: torch.device):
        import torch.distributed._symmetric_memory as symmetric_memory

        from gemma4serve.model.fused import kernels

        self.memory = symmetric_memory.empty(
            2 * tp.size * self.SOURCE_PACKETS, dtype=torch.int64, device=device
        )
        handle = symmetric_memory.rendezvous(self.memory, tp.group.group_name)
        self.memory.zero_()
        # Every rank's copy of this tensor, at the same offset in its allocation.
        offset = self.memory.data_ptr() - handle.buffer_ptrs[tp.rank]
        self.peers = kernels().PeerBuffers(
            rank=tp.rank,
            world=tp.size,
            buffers=torch.tensor([base + offset for base in handle.buffer_ptrs], device=device),
            epoch=torch.tensor([1, 0], device=device),
            source_packets=self.SOURCE_PACKETS,
            max_programs=torch.cuda.get_device_properties(device).multi_processor_count,
        )
        self.kernel = kernels().all_reduce_residual_norm
        torch.cuda.synchronize(device)
        dist.barrier(group=tp.group)  # every rank's buffer is zero before any rank writes to it

    @classmethod
    def create(cls, tp: TensorParallel, device: torch.device) -> FusedAllReduceNorm | None:
        """The buffers on every rank (a collective), or None where symmetric memory or the
        kernels do not run (an all-reduce, then the norm kernel, serve every call then)."""
        from gemma4serve.model.fused import kernels

        if kernels() is None:
            return None
        try:
            return cls(tp, device)
        except Exception as e:  # noqa: BLE001 - any failure leaves the unfused path, which works
            log.warning("fused all-reduce unavailable (%s: %s)", type(e).__name__, e)
            return None

    def fits(self, h: torch.Tensor) -> bool:
        return self.peers.fits(h) and h.shape[0] * (self.peers.world - 1) <= self.MAX_PEER_ROWS

    def __call__(self, x, h, weight, eps, scale, next_weight, pushed: bool = False):
        """(x + norm(sum over ranks of h)) * scale, and next_weight's norm of that (or None).
        `pushed`: h's GEMV sent its rows to the peers already."""
        return self.kernel(x, h, weight, eps, scale, next_weight, self.peers, pushed)


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: dist.ProcessGroup  # NCCL on CUDA, gloo on CPU
    one_shot: OneShotAllReduce | None = None  # small all-reduces on CUDA
    fused_norm: FusedAllReduceNorm | None = None  # the all-reduces before a residual norm

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (a row-parallel projection's partial outputs)."""
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def reduce_add_norm(
        self,
        ops,
        x: torch.Tensor,
        partial: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        next_weight: torch.Tensor | None = None,
        pushed: bool = False,
    ):
        """ops.add_norm(x, the sum over ranks of `partial`, ...): one kernel where the fused
        all-reduce fits, else an all-reduce and the norm. `pushed`: `partial`'s GEMV sent its
        rows to the peers already (`rows_to_push`)."""
        if self.fused_norm is not None and self.fused_norm.fits(partial):
            return self.fused_norm(x, partial, weight, eps, scale, next_weight, pushed)
        assert not pushed, "rows a GEMV sent are summed by the fused all-reduce"
        return ops.add_norm(x, self.all_reduce(partial), weight, eps, scale, next_weight)

    def rows_to_push(self, ops, x: torch.Tensor) -> PeerBuffers | None:
        """The peers that a row-parallel projection of x's rows (same count, x's width) sends its
        output to as it stores it, or None: where the GEMV computes it and the fused all-reduce
        takes it (both decided by shape, so every rank decides alike)."""
        fused = self.fused_norm
        if fused is None or not ops.gemv_fits(x) or not fused.fits(x):
            return None
        return fused.peers

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_into(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (start-up only: a host sync)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary rows this rank holds (an equal share each)."""
        n = vocab_size // self.size
        return self.rank * n, (self.rank + 1) * n

    def kv_head_block(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds: an equal share, or one replicated head when
        there are fewer KV heads than ranks (each serves the query heads beside it)."""
        if num_kv_heads >= self.size:
            n = num_kv_heads // self.size
            return self.rank * n, n
        return self.rank * num_kv_heads // self.size, 1


def vocab_parallel_lookup(
    tp: TensorParallel, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int, scale
) -> torch.Tensor:
    """weight[ids] * scale for a table split by vocabulary rows: each rank looks up its own ids,
    zeroes the rest, and the sum over ranks is exact (one rank is non-zero per row)."""
    start, end = tp.vocab_range(vocab_size)
    outside = (ids < start) | (ids >= end)
    local = torch.where(outside, 0, ids - start)
    rows = weight[local] * scale
    rows = rows.masked_fill(outside[:, None], 0)
    return tp.all_reduce(rows)


def vocab_parallel_argmax(tp: TensorParallel, best: BestTokens, vocab_size: int) -> torch.Tensor:
    """The first argmax over the whole vocabulary [T] from each rank's best of its shard: the
    largest key over ranks (one all-reduce), so the largest value, ties to the lowest token id."""
    start, _ = tp.vocab_range(vocab_size)
    keys = argmax_keys(best, start)
    dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=tp.group)
    return key_tokens(keys)


_LOW = 2**32 - 1  # a key's low 32 bits hold this minus the token id


def argmax_keys(best: BestTokens, start: int) -> torch.Tensor:
    """int64 keys that order as (value, then lower global token id): the fp32 value's bits made
    order-preserving in the high half. -0.0 becomes +0.0 first, as the two tie in torch.argmax."""
    bits = (best.values + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return ordered * 2**32 + (_LOW - (best.tokens + start))


def key_tokens(keys: torch.Tensor) -> torch.Tensor:
    """The global token ids of argmax_keys."""
    return _LOW - (keys & _LOW)


def vocab_parallel_logits(
    tp: TensorParallel, local_logits: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[T, V] from each rank's [T, V / size], written into `out` where given: every rank gets the
    full logits (it samples them with the same seeds, so the ranks draw the same tokens)."""
    parts = tp.all_gather(local_logits)  # [size, T, V / size]
    rows, shard = local_logits.shape
    if out is None:
        out = local_logits.new_empty(rows, tp.size * shard)
    out.view(rows, tp.size, shard).copy_(parts.permute(1, 0, 2))
    return out
