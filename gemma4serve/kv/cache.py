"""Device storage for the KV of every producer layer, one paged tensor pair per attention type."""

from __future__ import annotations

import torch

from gemma4serve.config import FULL, SLIDING, TextConfig


class KVCache:
    def __init__(
        self, cfg: TextConfig, num_pages: dict, page_size: int, dtype: torch.dtype, device
    ):
        self.page_size = page_size
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.slot_of_layer: dict[int, tuple[str, int]] = {}
        for kind in (SLIDING, FULL):
            producers = [layer for layer in cfg.producer_layers if layer.kind == kind]
            if not producers:
                continue
            for j, layer in enumerate(producers):
                self.slot_of_layer[layer.index] = (kind, j)
            hd, nkv = producers[0].head_dim, producers[0].num_kv_heads
            shape = (len(producers), num_pages[kind], page_size, nkv, hd)
            self.k[kind] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[kind] = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_pages, page_size, nkv, hd] K and V of producer layer `index`."""
        kind, j = self.slot_of_layer[index]
        return self.k[kind][j], self.v[kind][j]

    @staticmethod
    def bytes_per_page(cfg: TextConfig, kind: str, page_size: int, dtype: torch.dtype) -> int:
        producers = [layer for layer in cfg.producer_layers if layer.kind == kind]
        return (
            sum(2 * page_size * layer.num_kv_heads * layer.head_dim for layer in producers)
            * torch.finfo(dtype).bits
            // 8
        )
