"""Continuous batching: which sequences run this step, with how many tokens, on which pages.

Each step fills a token budget: running sequences first (a decode is its last token plus its
drafts: a verify), continuing prefills next, then newly admitted requests, all in one packed
forward. When the full pool runs out, the most recently admitted running sequence gives its pages
back and is re-queued to be recomputed later (preemption by recompute).
"""

from __future__ import annotations

from collections import deque

from gemma4serve.engine.sequence import ScheduledChunk, Sequence, Status
from gemma4serve.kv.manager import KVManager


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence wherever it is and return its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.pages)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.pages)
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
            chunk = self._chunk(seq, budget)
            end = chunk.start + chunk.num_query
            while not self.kv.can_grow(seq.pages, chunk.start, end):
                victim = self.running[-1]  # the most recently admitted one
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.kv.grow(seq.pages, chunk.start, end)
            chunks.append(chunk)
            budget -= chunk.num_query

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            chunk = self._chunk(seq, budget)
            if not self._fits(chunk, alone=not self.running and not chunks):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.kv.grow(seq.pages, chunk.start, chunk.start + chunk.num_query)
            chunks.append(chunk)
            budget -= chunk.num_query
        return chunks

    def would_admit(self, budget: int) -> bool:
        """Whether `schedule` would admit a waiting sequence next to the running ones, with
        `budget` tokens left after them."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return False
        return self._fits(self._chunk(self.waiting[0], budget), alone=not self.running)

    def _fits(self, chunk: ScheduledChunk, alone: bool) -> bool:
        end = chunk.start + chunk.num_query
        # Keep a page of headroom per running sequence so admissions do not force immediate
        # preemptions; with nothing else running, nothing could ever free pages: admit what fits.
        headroom = 0 if alone else len(self.running)
        return self.kv.full_pages_needed(
            chunk.seq.pages, end
        ) + headroom <= self.kv.full.num_free and self.kv.can_grow(
            chunk.seq.pages, chunk.start, end
        )

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledChunk:
        remaining = seq.num_tokens - seq.num_computed
        length = min(remaining, budget)
        drafts = []
        if length == remaining:
            # All k drafts even near the request's end (the commit cuts what runs past it): steps
            # with equal draft counts replay one CUDA graph and can be continued on the device.
            drafts = seq.drafts[: max(0, budget - length)]
        return ScheduledChunk(seq, seq.num_computed, length, drafts)
