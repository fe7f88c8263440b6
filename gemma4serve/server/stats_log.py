"""vLLM's periodic stats line in the server's log: throughput, load, KV use, prefix-cache hits and
speculative decoding since the last line, every `interval` seconds while there is work
(--disable-log-stats turns it off)."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import TYPE_CHECKING

from gemma4serve.engine.outputs import EngineStats

if TYPE_CHECKING:
    from gemma4serve.server.state import ServerState

logger = logging.getLogger("gemma4serve")

INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


def stats_lines(before: EngineStats, after: EngineStats, seconds: float) -> list[str]:
    """The lines for the `seconds` between two snapshots; none when the engine was idle all along
    (nothing ran then, nothing runs or waits now)."""
    prompt_tokens = after.prompt_tokens - before.prompt_tokens
    generation_tokens = after.generation_tokens - before.generation_tokens
    busy = after.num_running or after.num_waiting or before.num_running or before.num_waiting
    if not (busy or prompt_tokens or generation_tokens):
        return []
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    used = after.kv_pages_total - after.kv_pages_free
    lines = [
        f"Avg prompt throughput: {prompt_tokens / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {generation_tokens / seconds:.1f} tokens/s, "
        f"Running: {after.num_running} reqs, Waiting: {after.num_waiting} reqs, "
        f"GPU KV cache usage: {_percent(used, after.kv_pages_total)}, "
        f"Prefix cache hit rate: {_percent(hits, queried)}"
    ]
    verify_steps = after.spec_num_steps - before.spec_num_steps
    if verify_steps:
        drafted = after.spec_drafted_tokens - before.spec_drafted_tokens
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        earlier = before.spec_accepted_per_position
        positions = [
            count - (earlier[i] if i < len(earlier) else 0)
            for i, count in enumerate(after.spec_accepted_per_position)
        ]
        lines.append(
            f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / verify_steps:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            "Per-position acceptance rate: "
            f"{', '.join(f'{count / verify_steps:.3f}' for count in positions)}, "
            f"Avg Draft acceptance rate: {_percent(accepted, drafted)}"
        )
    return lines


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0.0%"


async def log_stats(state: ServerState, interval: float) -> None:
    """Log `stats_lines` every `interval` seconds until cancelled."""
    before, then = copy.deepcopy(state.engine.stats()), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        after, now = copy.deepcopy(state.engine.stats()), time.monotonic()
        for line in stats_lines(before, after, now - then):
            logger.info("%s", line)
        before, then = after, now
