"""How many pages each pool gets (docs/architecture.md, "KV cache: two pools, window-aware").

The sliding pool is sized from what the running sequences can ever hold at once — each keeps at
most the rows a reader can still reach plus one step's queries — and the full pool gets every
remaining byte. There is no swa:full ratio to tune.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemma4serve.config import FULL, SLIDING, ConfigError, TextConfig
from gemma4serve.kv.cache import KVCache


@dataclass
class KVPlan:
    full_pages: int
    sliding_pages: int
    sliding_keep: int
    max_model_len: int
    bytes: int


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def plan_kv(
    cfg: TextConfig,
    *,
    page_size: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_draft_tokens: int,
    draft_window: int | None,
    kv_bytes: int | None,
    kv_tokens: int | None,
    max_model_len: int | None,
) -> KVPlan:
    # Rows before the next query that someone still reads (target: W-1, drafter: W_a+1) ...
    keep = max(cfg.sliding_window - 1, (draft_window + 1) if draft_window else 0)
    # ... plus two steps' queries: with async scheduling a step is queued before the previous
    # one is read.
    per_seq = _ceil(keep + 2 * (num_draft_tokens + 1), page_size) + 2
    sliding_pages = max_num_seqs * per_seq + _ceil(max_num_batched_tokens, page_size) + 1
    sliding_page_bytes = KVCache.bytes_per_page(cfg, SLIDING, page_size, dtype)
    full_page_bytes = KVCache.bytes_per_page(cfg, FULL, page_size, dtype)
    if kv_tokens is not None:
        full_pages = _ceil(kv_tokens, page_size) + 1
    else:
        if kv_bytes is None:
            raise ConfigError("no KV cache memory budget given")
        left = kv_bytes - sliding_pages * sliding_page_bytes
        full_pages = left // full_page_bytes if full_page_bytes else 0
        if full_pages < 2:
            raise ConfigError(
                f"KV cache budget of {kv_bytes / 2**30:.2f} GiB is too small: "
                "the sliding pool alone needs "
                f"{sliding_pages * sliding_page_bytes / 2**30:.2f} GiB "
                f"for max_num_seqs={max_num_seqs}; "
                "lower --max-num-seqs or raise --gpu-memory-utilization / --kv-cache-memory"
            )
    capacity = (full_pages - 1) * page_size - num_draft_tokens - 1
    limit = min(cfg.max_position_embeddings, capacity)
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > cfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's "
            f"{cfg.max_position_embeddings} positions"
        )
    elif max_model_len > capacity and kv_tokens is None:
        raise ConfigError(
            f"max_model_len {max_model_len} does not fit the KV cache ({capacity} tokens); "
            "lower --max-model-len or give the cache more memory"
        )
    total = sliding_pages * sliding_page_bytes + full_pages * full_page_bytes
    return KVPlan(full_pages, sliding_pages, keep, max_model_len, total)
