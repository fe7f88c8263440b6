"""Helpers shared by the kernels: interpreter detection, exact rounding, launch sizing."""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Under TRITON_INTERPRET=1 (the CPU test path) bf16 arithmetic and bf16 tl.dot operate on raw bit
# patterns, and fp32 -> bf16 casts truncate. Kernels therefore do all math in fp32 after loading,
# feed fp32 operands to tl.dot when interpreting, and round with `round_to` below (bit exact RTNE on
# both paths).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 dot operands: always when interpreting; for fp32 tensors on GPU too (ieee precision,
    no tf32)."""
    return INTERPRET or dtype == torch.float32


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round fp32 `x` to DTYPE (round to nearest even) and keep it in fp32.

    Emulates one rounding point of the torch reference (a bf16 op's output) inside an fp32
    computation. bf16 is rounded with integer ops (three on GPU) because the interpreter's cast
    truncates.
    """
    if DTYPE == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def jit_kernels() -> list:
    """Every Triton kernel (JITFunction) of this package's modules, found by module name: the
    package's namespace holds functions in place of the modules they share a name with
    (paged_attention, gemv, ...)."""
    from triton.runtime.jit import JITFunction

    modules = [m for name, m in sys.modules.items() if name.startswith(f"{__package__}.")]
    return list({f for m in modules for f in vars(m).values() if isinstance(f, JITFunction)})


# Host arithmetic in plain ints: triton's helpers are constexpr functions, ~5 µs a call.
def next_pow2(n: int) -> int:
    return 1 << (max(1, int(n)) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a small stand-in on CPU, where only the interpreter
    runs)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def row_warps(block: int) -> int:
    """Warps for a kernel that holds one `block`-wide row tile."""
    return 1 if block <= 256 else 4 if block <= 2048 else 8


PDL_ENABLED = os.environ.get("GEMMA4SERVE_DISABLE_PDL") != "1"  # benchmarks flip it to compare


@functools.cache
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch (PDL, Hopper and newer).

    The kernel may start while the previous one drains, and waits in `wait_for_producer` before
    touching anything that one wrote. The kernel takes them as its `PDL` constexpr.
    GEMMA4SERVE_DISABLE_PDL=1 turns PDL off (for comparisons).
    """
    if INTERPRET or device.type != "cuda" or not PDL_ENABLED:
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"PDL": True, "launch_pdl": True} if _has_pdl(index) else {"PDL": False}


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has finished and its writes are visible, then let
    the next kernel launch (its programs get SM slots only as this kernel's programs retire).

    Every kernel waits before it lets the next one launch, so a kernel starts only after all kernels
    but the one just before it have finished (a torch op, launched without PDL, always finishes
    before the next starts). Before this call a kernel may therefore read anything its immediate
    predecessor does not write: weights and the step's inputs and metadata (cos/sin, cache slots,
    page tables), never the activations it consumes.
    """
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
