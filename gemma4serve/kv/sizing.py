"""How many arena pages the KV budget buys, and the context length they allow.

Nothing is reserved per sequence: a request of L tokens costs its full-layer pages for L positions
plus the sliding pages of one window (and of the chunk it prefills), drawn when it needs them. The
arena needs only to hold one `max_model_len` request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemma4serve.config import FULL, SLIDING, ConfigError, TextConfig
from gemma4serve.kv.cache import KVCache, page_tokens


@dataclass
class KVPlan:
    num_pages: int  # arena pages, the null page included
    page_tokens: dict[str, int]  # positions per page of each attention type
    page_bytes: int
    sliding_keep: int  # rows before the next query that a reader may still read
    max_model_len: int
    sequence_capacity: int = 0  # the longest sequence the arena holds alone
    # The most sliding rows a sequence maps at once: the window, the boundary rows kept for the
    # prefix cache, and two steps of queries (a step is queued before the one before it is read).
    peak_sliding_rows: int = 0

    @property
    def bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def request_pages(self, length: int, sliding_rows: int) -> int:
        """Pages one sequence of `length` tokens holds with `sliding_rows` sliding rows mapped."""
        full = -(-length // self.page_tokens[FULL])
        sliding = -(-min(length, sliding_rows) // self.page_tokens[SLIDING]) + 1
        return full + sliding

    def max_concurrency(self, length: int, sliding_rows: int) -> float:
        return (self.num_pages - 1) / self.request_pages(length, sliding_rows)


def plan_kv(
    cfg: TextConfig,
    *,
    page_size: int,
    dtype: torch.dtype,
    num_draft_tokens: int,
    draft_window: int | None,
    cache_boundary_rows: int,
    kv_bytes: int | None,
    kv_tokens: int | None,
    max_model_len: int | None,
) -> KVPlan:
    """`cache_boundary_rows`: the extra sliding rows prefix caching keeps (0 without it)."""
    # Rows before the next query that someone still reads (the target's W-1, the drafter's W_a+1).
    keep = max(cfg.sliding_window - 1, (draft_window + 1) if draft_window else 0)
    tokens = page_tokens(cfg, page_size)
    page_bytes = KVCache.bytes_per_page(cfg, tokens, dtype)
    plan = KVPlan(0, tokens, page_bytes, keep, 0)
    peak_rows = keep + cache_boundary_rows + 2 * (num_draft_tokens + 1)
    plan.peak_sliding_rows = peak_rows
    if kv_tokens is not None:  # test knob: room for one sequence of that many positions
        plan.num_pages = plan.request_pages(kv_tokens, peak_rows) + 1
    else:
        if kv_bytes is None:
            raise ConfigError("no KV cache memory budget given")
        plan.num_pages = kv_bytes // page_bytes
    limit = cfg.max_position_embeddings
    if plan.request_pages(limit, peak_rows) > plan.num_pages - 1:
        # The longest request one arena holds: full pages for the rest after one window.
        spare = plan.num_pages - 1 - plan.request_pages(0, 0) - (-(-peak_rows // tokens[SLIDING]))
        limit = max(0, spare * tokens[FULL] - num_draft_tokens - 1)
    plan.sequence_capacity = limit
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > cfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's "
            f"{cfg.max_position_embeddings} positions"
        )
    elif max_model_len > limit and kv_tokens is None:
        raise ConfigError(
            f"max_model_len {max_model_len} does not fit the KV cache ({limit} tokens); "
            "lower --max-model-len or give the cache more memory"
        )
    if max_model_len < 2:
        raise ConfigError(
            f"the KV cache budget ({plan.bytes / 2**30:.2f} GiB, {plan.num_pages} pages of "
            f"{page_bytes / 2**20:.1f} MiB) holds no request; raise --gpu-memory-utilization "
            "or --kv-cache-memory"
        )
    plan.max_model_len = max_model_len
    return plan
