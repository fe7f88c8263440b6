"""Counter-based random numbers: every value is a pure function of (seed, position, stream, column).

No generator state: a request's randomness at a position does not depend on the batch around it,
on earlier steps, or on whether speculation ran, which is what makes seeded sampling reproducible
with and without drafts. Every function is tensor arithmetic with static shapes (no host
synchronisation), so it can run inside a captured CUDA graph. On CUDA the keys (and `uniform`
over its first columns) are one kernel launch (kernels/counter_random.py, bit for bit these).
"""

from __future__ import annotations

import enum

import torch

from gemma4serve.model.fused import on

_M32 = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """Independent uses of the same (seed, position) draw from different streams."""

    # The exponential race that samples the token at a position (sampler.choose).
    SAMPLE = 0
    # Benchmark-only: how many drafts a verify step accepts (spec.ForcedAcceptance).
    FORCED_ACCEPTANCE = 7


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32) without int64 overflow: multiply by c's 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser: a bijection on [0, 2^32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(
    seed: torch.Tensor, position: torch.Tensor, stream: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from (seed, position, stream), chained through the finaliser."""
    kernels = on(seed)
    if kernels is not None:
        return kernels.random_row_keys(seed, position, stream)
    key = _fmix32((seed & _M32) ^ 0x9E3779B9)
    key = _fmix32(key ^ ((seed >> 32) & _M32))  # arithmetic shift + mask = the seed's high word
    key = _fmix32(key ^ (position & _M32))
    key1 = _fmix32(key ^ (((int(stream) + 1) * 0x27D4EB2F) & _M32))
    key2 = _fmix32(key1 ^ 0x165667B1)
    return key1, key2


def uniform_from_keys(key1: torch.Tensor, key2: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in (0, 1) for each row's keys (from `row_keys`) and column ids `col`."""
    # The column counter is scrambled by both keys (add, then xor) so rows are not shifted copies
    # of each other.
    col_mix = _mul32(col & _M32, 0x9E3779B1)
    h = _fmix32(((col_mix + key1[:, None]) & _M32) ^ key2[:, None])
    # 23 random bits + 0.5 are exact in fp32, so u is never 0 or 1.
    return ((h >> 9).float() + 0.5) * (2.0**-23)


def uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: int, cols: int | torch.Tensor
) -> torch.Tensor:
    """Uniform fp32 in (0, 1), a pure function of (seed, position, stream, column).

    seed, position: [N] int64. cols: an int C (columns 0..C-1) or an int64 tensor of column ids,
    [C] or [N, C]. Returns [N, C] f32. Values lie on the grid (i + 0.5) / 2^23, so never 0 or 1
    (-log stays finite).
    """
    kernels = on(seed)
    if kernels is not None and isinstance(cols, int):
        return kernels.random_uniform(seed, position, stream, cols)
    col = torch.arange(cols, device=seed.device) if isinstance(cols, int) else cols
    return uniform_from_keys(*row_keys(seed, position, stream), col)
