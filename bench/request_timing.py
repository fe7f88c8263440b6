"""One request's token deliveries, the latencies vLLM's `bench serve` reports from them, and the
statistics the benchmarks print (numpy's linear-interpolation percentile, as vLLM uses)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    start: float  # when the request was sent (or added to the engine)
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens that came)
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.deliveries)

    @property
    def ttft(self) -> float:
        return self.deliveries[0][0] - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.deliveries[-1][0] - self.deliveries[0][0]) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        """The gaps between deliveries, each spread over the tokens it delivered (with MTP several
        land at once)."""
        return [
            (now - before) / count
            for (before, _), (now, count) in zip(self.deliveries, self.deliveries[1:])
            for _ in range(count)
        ]


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated between the nearest ranks; nan when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = (len(xs) - 1) * q / 100
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
