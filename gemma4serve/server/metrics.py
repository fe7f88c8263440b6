"""Prometheus metrics, named like vLLM's with our prefix (`vllm:x` -> `gemma4serve:x`), so that
dashboards port by a search-and-replace; `--metrics-prefix vllm` gives vLLM's own names, for
dashboards, autoscalers and `vllm bench serve` that look for them.

Two sources, kept apart so that the engine thread never touches a prometheus object:
- engine state and counters (requests, KV pages, tokens, speculative decoding) are read from one
  `engine.stats()` snapshot when /metrics is scraped, by a custom collector;
- per-request latencies are histograms the server observes when a request finishes, from its
  RequestOutput.metrics.
Everything lives on a registry of its own: two apps in one process (tests) never share series.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gemma4serve.engine.outputs import ITERATION_TOKEN_BUCKETS, EngineStats, RequestOutput

FINISH_REASONS = (
    "stop",
    "length",
    "abort",
)  # always exported, so that rate() sees a series from the start

# vLLM's buckets, extended downwards: with MTP a token can take well under 10 ms.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineStatsCollector(Collector):
    """Turns one EngineStats snapshot per scrape into gauges and counters."""

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str, prefix: str):
        self._read_stats = read_stats
        self._model = model_name
        self._prefix = prefix + ":"

    def collect(self) -> Iterator[Metric]:
        s = self._read_stats()
        m = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(self._prefix + name, doc, labels=["model_name"])
            family.add_metric(m, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(self._prefix + name, doc, labels=["model_name"])
            family.add_metric(m, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)

        used = s.kv_pages_total - s.kv_pages_free
        yield gauge(
            "kv_cache_usage_perc",
            "KV arena pages held by running sequences (1 = full); idle cached pages count as free.",
            used / s.kv_pages_total if s.kv_pages_total else 0.0,
        )
        yield gauge("kv_cache_free_pages", "KV arena pages no sequence holds.", s.kv_pages_free)
        yield gauge("kv_cache_total_pages", "KV arena pages.", s.kv_pages_total)
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits
        )

        iteration = HistogramMetricFamily(
            self._prefix + "iteration_tokens_total",
            "Tokens per engine step: prompt chunks' tokens, decode and verify rows.",
            labels=["model_name"],
        )
        bounds = [str(float(b)) for b in ITERATION_TOKEN_BUCKETS] + ["+Inf"]
        cumulative = itertools.accumulate(s.iteration_tokens_counts)
        iteration.add_metric(m, list(zip(bounds, cumulative)), s.iteration_tokens_sum)
        yield iteration

        yield counter("num_preemptions", "Preemptions (recompute) since start.", s.num_preemptions)
        yield counter("prompt_tokens", "Prefill tokens processed.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)

        success = CounterMetricFamily(
            self._prefix + "request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        finished = {reason: 0 for reason in FINISH_REASONS} | dict(s.requests_finished)
        for reason, count in sorted(finished.items()):
            success.add_metric([self._model, str(reason)], count)
        yield success

        yield counter(
            "spec_decode_num_drafts", "Verify steps that carried drafts.", s.spec_num_steps
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_drafted_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            self._prefix + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            labels=["model_name", "position"],
        )
        for position, count in enumerate(s.spec_accepted_per_position):
            per_pos.add_metric([self._model, str(position)], count)
        yield per_pos
        yield gauge(
            "spec_decode_draft_length",
            "Drafts per sequence in the latest step (0: drafting is off at this load or there "
            "is no drafter).",
            s.draft_length,
        )
        yield gauge(
            "spec_decode_mean_accepted_length",
            "Tokens emitted per verify step, bonus token included (0 before any step).",
            s.spec_mean_accepted_length,
        )


class ServerMetrics:
    """The registry behind /metrics, and the histograms the server observes per finished request."""

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str, prefix: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(read_stats, model_name, prefix))
        ProcessCollector(
            registry=self.registry
        )  # memory, CPU, open fds: what an operator checks first
        self._model = model_name

        def histogram(name: str, doc: str, buckets) -> Histogram:
            family = Histogram(
                f"{prefix}:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
            )
            family.labels(model_name)  # exported from the start, so that rate() sees a series
            return family

        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Mean time per output token after the first.",
            TPOT_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS
        )

    def observe_finished(self, output: RequestOutput) -> None:
        """Record the latencies of a finished request (its last RequestOutput)."""
        t = output.metrics
        if t is None:
            return
        if t.first_scheduled_time is not None:
            self.queue.labels(self._model).observe(
                max(0.0, t.first_scheduled_time - t.arrival_time)
            )
        if t.first_token_time is not None:
            self.ttft.labels(self._model).observe(max(0.0, t.first_token_time - t.arrival_time))
        if t.finished_time is not None:
            self.e2e.labels(self._model).observe(max(0.0, t.finished_time - t.arrival_time))
            # n > 1: the longest choice sets the pace the client saw.
            longest = max((len(c.token_ids) for c in output.outputs), default=0)
            if t.first_token_time is not None and longest > 1:
                self.tpot.labels(self._model).observe(
                    max(0.0, t.finished_time - t.first_token_time) / (longest - 1)
                )

    def render(self) -> bytes:
        """The exposition text. Calls engine.stats(): run it off the event loop."""
        return generate_latest(self.registry)
