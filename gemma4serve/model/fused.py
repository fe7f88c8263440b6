"""The fused Triton kernels the model uses on CUDA (gemma4serve_kernels), or None where they cannot run.

The torch ops in layers.py are the reference; the kernels keep the same rounding points. For comparisons:
GEMMA4SERVE_DISABLE_FUSED=1 runs the reference ops on CUDA too, GEMMA4SERVE_GEMV_MAX_ROWS=0 sends every
projection to cuBLAS, GEMMA4SERVE_DISABLE_PDL=1 launches the kernels without programmatic dependent launch,
GEMMA4SERVE_DISABLE_GREEDY_HEAD=1 computes greedy tokens from the full logits (and saves the head's int8 copy).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import torch.nn.functional as F


@cache
def kernels():
    if os.environ.get("GEMMA4SERVE_DISABLE_FUSED") == "1" or not torch.cuda.is_available():
        return None
    try:
        import gemma4serve_kernels
    except ImportError:
        return None
    return gemma4serve_kernels


def on(x: torch.Tensor):
    """The kernel module if x lives where the kernels run, else None."""
    return kernels() if x.is_cuda else None


# Rows up to which `linear` uses the GEMV kernel (at most its row tile, 16).
GEMV_MAX_ROWS = int(os.environ.get("GEMMA4SERVE_GEMV_MAX_ROWS", "16"))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T without bias. Few-row inputs on CUDA (decode, verify, the draft loop) go to the streaming
    GEMV, so the step stays a chain of Triton kernels that overlap through PDL; the rest go to cuBLAS."""
    if _gemv_fits(x):
        return kernels().gemv(x, weight)
    return F.linear(x, weight)


def _gemv_fits(x: torch.Tensor) -> bool:
    """A few-row 2-D input on CUDA (decode, verify, the draft loop), within the GEMV's row tile."""
    return on(x) is not None and x.dim() == 2 and x.shape[0] <= gemv_max_rows() and x.stride(1) == 1


def gemv_max_rows() -> int:
    """Rows up to which few-row inputs on CUDA take the GEMV (and the greedy head)."""
    return min(GEMV_MAX_ROWS, kernels().GEMV_MAX_ROWS)


def gelu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(gelu_tanh(x @ gate^T) * (x @ up^T)) for a fused [gate; up] weight. Few-row inputs: gemv_mlp (the GEMV
    with the GELU·up epilogue, so no [T, 2I] intermediate, then down; for wide MLPs without a kernel boundary
    between them); else the GEMM, the activation kernel and the down GEMM."""
    if _gemv_fits(x):
        return kernels().gemv_mlp(x, gate_up, down)
    return F.linear(kernels().gelu_tanh_mul(F.linear(x, gate_up)), down)


class GreedyHead:
    """Greedy tokens of a bf16 LM head and its softcap for few-row inputs, exactly as the argmax of the full
    logits, reading the head mostly as an int8 copy (kernels/greedy_head.py; the copy costs half the head's
    memory, 1.4 GB for the 31B)."""

    def __init__(self, weight: torch.Tensor, softcap):
        k = kernels()
        self.weight = weight
        self.q, self.scale = k.quantize_rows(weight)
        self.table = k.value_table(softcap, weight.device)

    @staticmethod
    def enabled(weight: torch.Tensor) -> bool:
        return (
            on(weight) is not None
            and weight.dtype == torch.bfloat16
            and os.environ.get("GEMMA4SERVE_DISABLE_GREEDY_HEAD") != "1"
        )

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return kernels().greedy_head(hidden, self.weight, self.q, self.scale, self.table)


def argmax_tokens(head: GreedyHead | None, hidden: torch.Tensor, logits) -> torch.Tensor:
    """The first argmax of logits(hidden) per row, [T] int64: through the greedy head where it takes these rows
    (the same tokens, most of the head read as int8)."""
    if head is not None and _gemv_fits(hidden):
        return head(hidden)
    return logits(hidden).argmax(-1)


def concat_weights(*linears) -> torch.Tensor:
    """One weight for several projections of the same input (one GEMM instead of several); the original
    parameters become views into it, so names and the state dict are unchanged and no memory is duplicated."""
    fused = torch.cat([l.weight for l in linears], dim=0)
    start = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight = torch.nn.Parameter(fused[start : start + n], requires_grad=False)
        start += n
    return fused
