"""Packed token bitmasks (xgrammar's layout: bit t % 32 of int32 word t // 32 = token t allowed)
and their application to logits."""

from __future__ import annotations

import torch


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(V / 32)] int32 on the host, every token allowed."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with each row's disallowed tokens at -inf (one unpack and one masked_fill on
    the logits' device; bitmask [R, ceil(V / 32)] int32 on that device)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().view(bitmask.shape[0], -1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))
