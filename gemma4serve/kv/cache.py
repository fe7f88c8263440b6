"""Device storage for the KV of every producer layer: one arena of equal-byte pages.

A page serves one attention type at a time and holds, for `page_tokens[kind]` consecutive
positions, the K and V of every producer layer of that type, laid out [K|V, layer, token, head,
dim]. Tokens per page differ by type so that pages are of equal bytes (the 31B: 16 positions of its
50 sliding layers or 160 of its 10 full layers, 13 MB either way). A layer's K (or V) is a view
[num_pages, page_tokens, nkv, hd] whose page stride is the whole page: kernels address pages
through that stride.
"""

from __future__ import annotations

import torch

from gemma4serve.config import FULL, SLIDING, TextConfig


def _producers(cfg: TextConfig, kind: str):
    return [layer for layer in cfg.producer_layers if layer.kind == kind]


def token_elements(cfg: TextConfig, kind: str) -> int:
    """Elements one position of `kind` takes over all its producer layers, K and V."""
    return sum(2 * layer.num_kv_heads * layer.head_dim for layer in _producers(cfg, kind))


def page_tokens(cfg: TextConfig, page_size: int) -> dict[str, int]:
    """Positions per page of each type: `page_size` for the type with the most bytes per position,
    as many as fit the same bytes for the other."""
    elements = {kind: token_elements(cfg, kind) for kind in (SLIDING, FULL)}
    widest = max(elements.values())
    return {
        kind: max(1, page_size * widest // n) if n else page_size for kind, n in elements.items()
    }


class KVCache:
    def __init__(
        self,
        cfg: TextConfig,
        num_pages: int,
        tokens: dict[str, int],
        dtype: torch.dtype,
        device,
    ):
        self.page_tokens = tokens
        self.page_elements = max(tokens[kind] * token_elements(cfg, kind) for kind in tokens)
        self.arena = torch.zeros(num_pages, self.page_elements, dtype=dtype, device=device)
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind in (SLIDING, FULL):
            producers = _producers(cfg, kind)
            for j, layer in enumerate(producers):
                nkv, hd = layer.num_kv_heads, layer.head_dim
                rows = tokens[kind] * nkv * hd  # one layer's K (or V) in one page
                shape = (num_pages, tokens[kind], nkv, hd)
                strides = (self.page_elements, nkv * hd, hd, 1)
                k = self.arena.as_strided(shape, strides, j * rows)
                v = self.arena.as_strided(shape, strides, (len(producers) + j) * rows)
                self.layers[layer.index] = (k, v)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_pages, page_tokens, nkv, hd] K and V of producer layer `index`."""
        return self.layers[index]

    @staticmethod
    def bytes_per_page(cfg: TextConfig, tokens: dict[str, int], dtype: torch.dtype) -> int:
        elements = max(tokens[kind] * token_elements(cfg, kind) for kind in tokens)
        return elements * torch.finfo(dtype).bits // 8
