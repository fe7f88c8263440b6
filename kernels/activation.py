"""GELU(tanh) of the gate times up: the MLP's, from one fused [T, 2I] gate/up projection output
(docs/gemma4.md §2), and PLE's gate times the layer's per-layer input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import pdl_args, round_to, wait_for_producer


@triton.jit
def gelu_tanh_f32(x):
    """0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))) in fp32.

    tanh is written out so that it saturates as in torch: exactly -1 far in the negative tail, so
    those outputs are exactly 0 as in the reference.
    """
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    e = tl.exp(-2.0 * tl.abs(z))
    th = (1.0 - e) / (1.0 + e)
    return 0.5 * x * (1.0 + tl.where(z < 0.0, -th, th))


@triton.jit
def gelu_times(gate, up, DT: tl.constexpr):
    """gelu_tanh(gate) * up for fp32 gate and up that hold DT values, rounded where those torch
    ops round on DT tensors: the GELU output, then the product."""
    return round_to(round_to(gelu_tanh_f32(gate), DT) * up, DT)


@triton.jit
def _gelu_mul_kernel(
    gate_ptr,
    up_ptr,
    o_ptr,
    inter,
    stride_g,
    stride_u,
    stride_o,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    DT: tl.constexpr = o_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    y = gelu_times(gate, up, DT)
    tl.store(o_ptr + row * stride_o + offs, y.to(DT), mask=mask)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns first, then up) -> [T, I]."""
    assert gate_up.shape[-1] % 2 == 0
    g2 = gate_up.reshape(-1, gate_up.shape[-1])
    inter = g2.shape[1] // 2
    return gelu_tanh_times(g2[:, :inter], g2[:, inter:]).view(*gate_up.shape[:-1], inter)


def gelu_tanh_times(
    gate: torch.Tensor, up: torch.Tensor, block: int | None = None, num_warps: int | None = None
) -> torch.Tensor:
    """gelu_tanh(gate) * up for [T, I] each (rows may be strided) -> [T, I]. `block` (values a
    program) and `num_warps` override the launch (benchmarks)."""
    assert gate.shape == up.shape and gate.dim() == 2
    assert gate.stride(1) == 1 and up.stride(1) == 1
    rows, inter = gate.shape
    out = torch.empty(rows, inter, dtype=gate.dtype, device=gate.device)
    if rows:
        block = block or min(1024, triton.next_power_of_2(inter))
        _gelu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate,
            up,
            out,
            inter,
            gate.stride(0),
            up.stride(0),
            out.stride(0),
            BLOCK=block,
            # 8 values a thread: nearer the copy bandwidth (docs/performance.md)
            num_warps=num_warps or 2,
            **pdl_args(gate.device),
        )
    return out
