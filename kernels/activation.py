"""GELU(tanh) of the gate times up, from one fused [T, 2I] gate/up projection output.

The MLP of docs/gemma4.md §2.
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
def _gelu_mul_kernel(
    gu_ptr, o_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    wait_for_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    DT: tl.constexpr = o_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_g + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounding points of `gelu_tanh(gate) * up` on bf16 tensors: the GELU output, then the product.
    y = round_to(round_to(gelu_tanh_f32(gate), DT) * up, DT)
    tl.store(o_ptr + row * stride_o + offs, y.to(DT), mask=mask)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate columns first, then up) -> [T, I]."""
    assert gate_up.shape[-1] % 2 == 0 and gate_up.stride(-1) == 1
    g2 = gate_up.reshape(-1, gate_up.shape[-1])
    inter = g2.shape[1] // 2
    out = torch.empty(g2.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _gelu_mul_kernel[(g2.shape[0], triton.cdiv(inter, block))](
            g2,
            out,
            inter,
            g2.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=4,
            **pdl_args(gate_up.device),
        )
    return out.view(*gate_up.shape[:-1], inter)
