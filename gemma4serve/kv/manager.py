"""Which pages each sequence holds in the full and the sliding pool.

See docs/architecture.md ("KV cache: two pools, window-aware") and docs/gemma4.md §12.3.

A sequence maps logical page i (positions i*page_size …) to a physical page, one list per pool.
Full pages are kept for the life of the sequence. Sliding pages are kept only while some reader can
still reach them: the target reads W-1 rows back from its next query, the drafter W_a+1 rows back
from P; everything older goes back to the free list (its table entry becomes the null page 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gemma4serve.kv.pool import PagePool


@dataclass
class SeqPages:
    full: list[int] = field(default_factory=list)
    sliding: list[int] = field(default_factory=list)  # 0 = released (or never needed)


class KVManager:
    def __init__(self, full: PagePool, sliding: PagePool, page_size: int, sliding_keep: int):
        self.full = full
        self.sliding = sliding
        self.page_size = page_size
        self.sliding_keep = (
            sliding_keep  # rows before the next query position that a reader may still read
        )

    def pages_for(self, end: int) -> int:
        return -(-end // self.page_size)

    def full_pages_needed(self, pages: SeqPages, end: int) -> int:
        return max(0, self.pages_for(end) - len(pages.full))

    def _first_sliding_page(self, start: int) -> int:
        """The lowest logical page anyone still reads when the next write is at `start`."""
        return max(0, start - self.sliding_keep) // self.page_size

    def _missing_sliding(self, pages: SeqPages, start: int, end: int) -> list[int]:
        """Logical pages of [start - keep, end) that hold no sliding page yet."""
        return [
            i
            for i in range(self._first_sliding_page(start), self.pages_for(end))
            if i >= len(pages.sliding) or pages.sliding[i] == 0
        ]

    def sliding_pages_needed(self, pages: SeqPages, start: int, end: int) -> int:
        return len(self._missing_sliding(pages, start, end))

    def can_grow(self, pages: SeqPages, start: int, end: int) -> bool:
        return (
            self.full_pages_needed(pages, end) <= self.full.num_free
            and self.sliding_pages_needed(pages, start, end) <= self.sliding.num_free
        )

    def grow(self, pages: SeqPages, start: int, end: int) -> None:
        """Map positions < end in the full pool and [start - keep, end) in the sliding pool.

        `start` is the first position this step writes. Sliding pages below that range are
        released first.
        """
        self.release_unreachable(pages, start)
        pages.full.extend(self.full.allocate(self.full_pages_needed(pages, end)))
        missing = self._missing_sliding(pages, start, end)
        n = self.pages_for(end)
        if len(pages.sliding) < n:
            pages.sliding.extend([0] * (n - len(pages.sliding)))
        for i, p in zip(missing, self.sliding.allocate(len(missing))):
            pages.sliding[i] = p

    def grow_all(self, spans: list[tuple[SeqPages, int, int]]) -> bool:
        """`grow` every (pages, start, end) if all of them fit together; else change nothing."""
        full = sum(self.full_pages_needed(p, end) for p, _, end in spans)
        sliding = sum(self.sliding_pages_needed(p, start, end) for p, start, end in spans)
        if full > self.full.num_free or sliding > self.sliding.num_free:
            return False
        for p, start, end in spans:
            self.grow(p, start, end)
        return True

    def release_unreachable(self, pages: SeqPages, start: int) -> None:
        dead = self._first_sliding_page(start)  # pages wholly below the lowest row anyone reads
        freed = [p for p in pages.sliding[:dead] if p]
        if freed:
            self.sliding.free(freed)
            pages.sliding[:dead] = [0] * dead

    def free(self, pages: SeqPages) -> None:
        self.full.free(pages.full)
        self.sliding.free([p for p in pages.sliding if p])
        pages.full.clear()
        pages.sliding.clear()
