"""The periodic stats lines (server/stats_log.py): vLLM's wording, rates over the interval."""

from __future__ import annotations

import dataclasses

from gemma4serve.engine.outputs import EngineStats
from gemma4serve.server.stats_log import stats_lines


def test_idle_gives_no_lines():
    assert stats_lines(EngineStats(), EngineStats(), 10.0) == []


def test_rates_load_and_drafts_since_the_last_line():
    before = EngineStats(
        prompt_tokens=100,
        generation_tokens=50,
        prefix_cache_queries=100,
        prefix_cache_hits=10,
        spec_num_steps=10,
        spec_drafted_tokens=20,
        spec_accepted_tokens=10,
        spec_accepted_per_position=[6],
    )
    after = dataclasses.replace(
        before,
        num_running=3,
        num_waiting=1,
        kv_pages_total=200,
        kv_pages_free=150,
        prompt_tokens=1100,
        generation_tokens=250,
        prefix_cache_queries=1100,
        prefix_cache_hits=510,
        spec_num_steps=110,
        spec_drafted_tokens=220,
        spec_accepted_tokens=160,
        spec_accepted_per_position=[86, 64],
    )
    load, spec = stats_lines(before, after, 10.0)
    assert load == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, "
        "Prefix cache hit rate: 50.0%"
    )
    assert spec == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 150 tokens, "
        "Drafted: 200 tokens, Per-position acceptance rate: 0.800, 0.640, "
        "Avg Draft acceptance rate: 75.0%"
    )


def test_a_request_still_running_keeps_the_lines_coming():
    running = EngineStats(num_running=1)
    assert len(stats_lines(running, running, 10.0)) == 1
