"""Counter-based random numbers in one launch: the engine's `random_streams` on the device.

In torch each murmur3 finaliser is ~16 elementwise launches (the 32-bit multiply is emulated in
int64 with masks), and a row's keys chain five of them: ~85 launches for every sampled or
forced-acceptance step, each waiting on the host. Here uint32 arithmetic wraps as the torch code
masks, so the keys and values are bit for bit the torch reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fmix32(h):
    """murmur3's 32-bit finaliser on uint32 (multiplication wraps mod 2^32)."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


# One compiled variant whatever the row count (a new specialisation would compile mid-serving).
@triton.jit(do_not_specialize=["N"])
def _counter_kernel(
    seed_ptr,
    position_ptr,
    key1_ptr,
    key2_ptr,
    uniform_ptr,
    N,
    STREAM_MIX: tl.constexpr,
    COLS: tl.constexpr,
    COLS_P: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per row: the two keys of (seed, position, stream), and the uniforms of columns 0..COLS-1."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    seed = tl.load(seed_ptr + i, mask=inside, other=0)
    position = tl.load(position_ptr + i, mask=inside, other=0)
    key = _fmix32(seed.to(tl.uint32) ^ 0x9E3779B9)
    key = _fmix32(key ^ (seed >> 32).to(tl.uint32))  # the seed's high word
    key = _fmix32(key ^ position.to(tl.uint32))
    key1 = _fmix32(key ^ tl.full([BLOCK], STREAM_MIX, tl.uint32))
    key2 = _fmix32(key1 ^ 0x165667B1)
    tl.store(key1_ptr + i, key1.to(tl.int64), mask=inside)
    tl.store(key2_ptr + i, key2.to(tl.int64), mask=inside)
    if COLS > 0:
        c = tl.arange(0, COLS_P)
        h = _fmix32((c.to(tl.uint32)[None, :] * 0x9E3779B1 + key1[:, None]) ^ key2[:, None])
        # 23 random bits + 0.5 are exact in fp32, so u is never 0 or 1.
        u = ((h >> 9).to(tl.float32) + 0.5) * (2.0**-23)
        out = i[:, None] * COLS + c[None, :]
        tl.store(uniform_ptr + out, u, mask=inside[:, None] & (c < COLS)[None, :])


def stream_mix(stream: int) -> int:
    """The word a stream's keys are mixed with (random_streams.row_keys)."""
    return ((int(stream) + 1) * 0x27D4EB2F) & 0xFFFFFFFF


def _launch(seed: torch.Tensor, position: torch.Tensor, stream: int, cols: int):
    N = seed.shape[0]
    assert position.shape == (N,) and cols >= 0
    key1 = torch.empty(N, dtype=torch.int64, device=seed.device)
    key2 = torch.empty_like(key1)
    u = torch.empty(N, cols, dtype=torch.float32, device=seed.device)
    block = 128
    _counter_kernel[(triton.cdiv(N, block),)](
        seed.to(torch.int64).contiguous(), position.to(torch.int64).contiguous(), key1, key2, u, N,
        STREAM_MIX=stream_mix(stream), COLS=cols, COLS_P=triton.next_power_of_2(cols), BLOCK=block,
    )  # fmt: skip
    return key1, key2, u


def random_row_keys(seed: torch.Tensor, position: torch.Tensor, stream: int):
    """random_streams.row_keys: (key1, key2) [N] int64 in [0, 2^32) of seed, position [N] int64."""
    key1, key2, _ = _launch(seed, position, stream, 0)
    return key1, key2


def random_uniform(
    seed: torch.Tensor, position: torch.Tensor, stream: int, cols: int
) -> torch.Tensor:
    """random_streams.uniform over columns 0..cols-1: [N, cols] fp32."""
    return _launch(seed, position, stream, cols)[2]
