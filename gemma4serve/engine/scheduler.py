"""Continuous batching: which sequences run this step, with how many tokens, on which pages.

Each step fills a token budget: running sequences first (a decode is its last token plus its
drafts: a verify), continuing prefills next, then newly admitted requests, all in one packed
forward. When the full pool runs out, the most recently admitted running sequence gives its pages
back and is re-queued to be recomputed later (preemption by recompute).

A request is admitted only if the pages it and the running sequences are expected to draw until
they finish still fit: a preempted sequence's work is lost, and near a full arena the pages it
frees are drawn by the others before it can return (it would be preempted again and again). The
expected length is what recent requests used of their max_tokens.
"""

from __future__ import annotations

import math
from collections import deque

from gemma4serve.engine.sequence import ScheduledChunk, Sequence, Status
from gemma4serve.kv.manager import KVManager, SeqPages
from gemma4serve.kv.prefix_cache import CacheHit

# Output beyond this many tokens is not reserved for: without max_tokens a request may ask for the
# whole context, which would keep any other request out.
OUTPUT_HORIZON = 4096
RECENT_REQUESTS = 64  # finished requests the expected output length is taken from


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        # The share of their (horizon-capped) max_tokens that recent requests generated, and its
        # mean; until one finishes, all of it.
        self.output_shares: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.output_share = 1.0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is and return its pages (its final rows
        go to the prefix cache)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq, committed=seq.num_computed)
        seq.status = Status.FINISHED
        wanted = min(seq.max_len - seq.num_prompt, OUTPUT_HORIZON)
        if seq.finish_reason != "abort" and wanted > 0:
            generated = seq.num_tokens - seq.num_prompt
            self.output_shares.append(min(generated, wanted) / wanted)
            self.output_share = sum(self.output_shares) / len(self.output_shares)

    def expected_end(self, seq: Sequence) -> int:
        """The length `seq` is expected to reach, by what recent requests generated."""
        wanted = min(seq.max_len - seq.num_prompt, OUTPUT_HORIZON)
        return max(seq.num_tokens, seq.num_prompt + math.ceil(self.output_share * wanted))

    def reserved_pages(self) -> int:
        """Pages the running sequences are expected to draw before they finish."""
        return sum(self.kv.growth(seq.pages, self.expected_end(seq)) for seq in self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq, committed=seq.num_computed)  # cached: its recompute may start from there
        seq.num_computed = 0
        seq.drafts = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            chunk = self._chunk(seq, budget, seq.pages, seq.num_computed, self.kv.pool.num_free)
            while not self.kv.can_grow(seq, chunk.start, chunk.start + chunk.num_query):
                victim = self.running[-1]  # the most recently admitted one
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.kv.grow(seq, chunk.start, chunk.start + chunk.num_query)
            self.kv.offer_written(seq, chunk.start + chunk.num_query)
            chunks.append(chunk)
            budget -= chunk.num_query
        return chunks + self.admit(budget)

    def continue_prompts(
        self, on_device: set[Sequence], budget: int
    ) -> list[ScheduledChunk] | None:
        """The next chunks, within `budget`, of the running sequences not in `on_device` (prompts
        part-way through), their pages grown: a step continued on the device takes them beside
        its own rows. None where one would verify drafts (those come from the host only after the
        step in flight is read) or its pages do not fit (the scheduled step preempts)."""
        chunks: list[ScheduledChunk] = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq in on_device:
                continue
            chunk = self._chunk(seq, budget, seq.pages, seq.num_computed, self.kv.pool.num_free)
            end = chunk.start + chunk.num_query
            if chunk.drafts or not self.kv.can_grow(seq, chunk.start, end):
                return None
            self.kv.grow(seq, chunk.start, end)
            chunks.append(chunk)
            budget -= chunk.num_query
        for chunk in chunks:  # they launch now (none would have, had one not fit)
            self.kv.offer_written(chunk.seq, chunk.start + chunk.num_query)
        return chunks

    def admit(self, budget: int, admissible=lambda seq: True) -> list[ScheduledChunk]:
        """Admit waiting sequences, in order, into `budget` tokens beside the running ones: each
        one's first chunk. Stops at the first that does not fit or that `admissible` refuses."""
        chunks: list[ScheduledChunk] = []
        reserved = None  # the running sequences' expected pages, summed once a request is tried
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not admissible(seq):
                break
            hit = self._lookup(seq)
            if reserved is None:
                reserved = self.reserved_pages()
            alone = not self.running
            chunk = self._admissible_chunk(seq, budget, hit, alone, reserved)
            if chunk is None:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.num_cached_tokens is None:  # reported once, at the first admission
                seq.num_cached_tokens = hit.tokens if hit is not None else 0
                self.kv.record_lookup(seq, hit)
            if hit is not None:
                self.kv.adopt(seq, hit)
                seq.num_computed = hit.tokens
            self.kv.grow(seq, chunk.start, chunk.start + chunk.num_query)
            self.kv.offer_written(seq, chunk.start + chunk.num_query)  # the next may start there
            reserved += self.kv.growth(seq.pages, self.expected_end(seq))
            chunks.append(chunk)
            budget -= chunk.num_query
        return chunks

    def would_admit(self, budget: int) -> bool:
        """Whether `schedule` would admit a waiting sequence next to the running ones, with
        `budget` tokens left after them."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return False
        seq = self.waiting[0]
        hit = self._lookup(seq)
        alone = not self.running
        return self._admissible_chunk(seq, budget, hit, alone, self.reserved_pages()) is not None

    def _lookup(self, seq: Sequence):
        # A request that wants prompt logprobs computes its whole prompt (vLLM does the same).
        return None if seq.params.prompt_logprobs is not None else self.kv.lookup(seq)

    def _admissible_chunk(
        self, seq: Sequence, budget: int, hit: CacheHit | None, alone: bool, reserved: int
    ):
        """The chunk a waiting sequence would start with (from its cache hit), or None when it
        does not fit: its chunk now, and (beside others) its expected pages with the `reserved`
        ones of the running sequences. Keeps a page of headroom per running sequence so
        admissions do not force immediate preemptions; with nothing else running, nothing could
        ever free pages."""
        headroom = 0 if alone else len(self.running)
        pages = self.kv.hit_pages(hit) if hit is not None else seq.pages
        start = hit.tokens if hit is not None else seq.num_computed
        # The hit's idle pages stop counting as free once the sequence holds them.
        available = self.kv.pool.num_free - self.kv.idle_pages(hit) - headroom
        if not alone and self.kv.growth(pages, self.expected_end(seq)) + reserved > available:
            return None
        chunk = self._chunk(seq, budget, pages, start, available)
        fits = self.kv.pages_needed(pages, chunk.start, chunk.start + chunk.num_query) <= available
        return chunk if fits else None

    def _chunk(
        self, seq: Sequence, budget: int, pages: SeqPages, start: int, available: int
    ) -> ScheduledChunk:
        """The next chunk of `seq` from `start` within the token budget; a prefill chunk is
        shortened to fit `available` pages when it would not (a budget smaller than one full
        prefill chunk still serves)."""
        remaining = seq.num_tokens - start
        length = min(remaining, budget)
        chunk = self._with_drafts(seq, start, length, remaining, budget)

        def fits(n: int) -> bool:
            return self.kv.pages_needed(pages, start, start + n) <= available

        if length <= 1 or fits(chunk.num_query):
            return chunk
        low, high = 1, length - 1  # the longest prefill prefix that fits (drafts need the end)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return ScheduledChunk(seq, start, low, [])

    @staticmethod
    def _with_drafts(seq: Sequence, start: int, length: int, remaining: int, budget: int):
        drafts = []
        if length == remaining:
            # All k drafts even near the request's end (the commit cuts what runs past it): steps
            # with equal draft counts replay one CUDA graph and can be continued on the device.
            drafts = seq.drafts[: max(0, budget - length)]
        return ScheduledChunk(seq, start, length, drafts)
