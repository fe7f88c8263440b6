"""Which arena pages each sequence holds, for its full and its sliding layers.

See docs/architecture.md ("KV cache: one arena, pages on demand") and docs/gemma4.md §12.3.

Both layer types draw equal-byte pages from one arena when a sequence needs them; a page holds
`page_tokens[kind]` positions of its type. A sequence maps logical page i of a type (positions
i * page_tokens[kind] ...) to a physical page. Full pages are kept for the life of the sequence.
Sliding pages are kept only while some reader can still reach them: the target reads W-1 rows back
from its next query, the drafter W_a+1 rows back from P; older ones go back to the arena (their
table entry becomes the null page 0). With prefix caching, pages may be shared: they are held by
reference, and a hit maps a cached prefix's pages into a new sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gemma4serve.config import FULL, SLIDING
from gemma4serve.kv.pool import PagePool
from gemma4serve.kv.prefix_cache import CacheHit, PrefixCache
from gemma4serve.kv.sizing import KVPlan

# Prefix-cache windows inside long sequences: one every this many tokens (besides the prompt's
# and the sequence's last boundary), so a long shared prefix is a hit wherever it ends.
PREFIX_WINDOW_INTERVAL = 2048


@dataclass
class SeqPages:
    full: list[int] = field(default_factory=list)
    sliding: list[int] = field(default_factory=list)  # 0 = released (or never needed)
    sliding_released: int = 0  # every sliding entry below this is 0: releases scan from here
    hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain hashes of full pages
    num_cached_full: int = 0  # full pages offered to the prefix cache
    windows_done: int = 0  # positions whose cache windows were offered


class PagedSequence(Protocol):
    """What the manager reads of a sequence."""

    pages: SeqPages
    token_ids: list[int]
    num_prompt: int
    cache_salt: str | None  # prefix-cache pages are shared only among requests of one salt

    @property
    def num_tokens(self) -> int: ...


class KVManager:
    def __init__(
        self,
        pool: PagePool,
        page_tokens: dict[str, int],
        sliding_keep: int,
        peak_sliding_rows: int,
        cache: PrefixCache | None = None,
    ):
        self.pool = pool
        self.page_tokens = page_tokens
        self.sliding_keep = sliding_keep  # rows before the next query that a reader may read
        self.peak_sliding_rows = peak_sliding_rows  # the most a sequence maps at once (KVPlan)
        self.cache = cache

    @classmethod
    def for_plan(cls, plan: KVPlan, model_key: str | None) -> KVManager:
        """The pages of `plan`'s arena, with a prefix cache rooted in `model_key` (None: none)."""
        pool = PagePool(plan.num_pages)
        cache = None
        if model_key is not None:
            cache = PrefixCache(
                pool,
                full_page_tokens=plan.page_tokens[FULL],
                sliding_page_tokens=plan.page_tokens[SLIDING],
                sliding_keep=plan.sliding_keep,
                model_key=model_key,
                window_interval=PREFIX_WINDOW_INTERVAL,
            )
        return cls(pool, plan.page_tokens, plan.sliding_keep, plan.peak_sliding_rows, cache)

    def pages_for(self, end: int, kind: str) -> int:
        return -(-end // self.page_tokens[kind])

    def _first_sliding_page(self, start: int) -> int:
        """The lowest logical page anyone still reads when the next write is at `start` (with
        prefix caching, also the window of the last cacheable boundary, offered when the
        sequence ends)."""
        lowest = start - self.sliding_keep
        if self.cache is not None:
            lowest = min(lowest, self.cache.last_boundary(start) - self.sliding_keep)
        return max(0, lowest) // self.page_tokens[SLIDING]

    def _missing_sliding(self, pages: SeqPages, start: int, end: int) -> list[int]:
        """Logical pages of [start - keep, end) that hold no sliding page yet."""
        return [
            i
            for i in range(self._first_sliding_page(start), self.pages_for(end, SLIDING))
            if i >= len(pages.sliding) or pages.sliding[i] == 0
        ]

    def pages_needed(self, pages: SeqPages, start: int, end: int) -> int:
        """New arena pages to map positions < end (full) and [start - keep, end) (sliding)."""
        full = max(0, self.pages_for(end, FULL) - len(pages.full))
        return full + len(self._missing_sliding(pages, start, end))

    def growth(self, pages: SeqPages, end: int) -> int:
        """The most pages a sequence holding `pages` may still draw on its way to `end` positions:
        its full pages below `end` and its widest sliding span, less what it holds now."""
        widest = self.pages_for(self.peak_sliding_rows, SLIDING) + 1
        full = self.pages_for(end, FULL)
        sliding = min(self.pages_for(end, SLIDING), widest)
        # Pages further back than the widest span are released: only the tail can be held.
        tail = pages.sliding[-widest:]
        held = len(pages.full) + len(tail) - tail.count(0)
        return max(0, full + sliding - held)

    def can_grow(self, seq: PagedSequence, start: int, end: int) -> bool:
        return self.pages_needed(seq.pages, start, end) <= self.pool.num_free

    def grow(self, seq: PagedSequence, start: int, end: int) -> None:
        """Map positions < end (full) and [start - keep, end) (sliding), where `start` is the first
        position this step writes: every row below it is final. Sliding pages below that range
        are released first (cache windows below `start` are offered before)."""
        pages = seq.pages
        self._offer_to_cache(seq, start)
        self._release_unreachable(pages, start)
        full = max(0, self.pages_for(end, FULL) - len(pages.full))
        pages.full.extend(self.pool.allocate(full))
        missing = self._missing_sliding(pages, start, end)
        n = self.pages_for(end, SLIDING)
        if len(pages.sliding) < n:
            pages.sliding.extend([0] * (n - len(pages.sliding)))
        for i, page in zip(missing, self.pool.allocate(len(missing))):
            pages.sliding[i] = page

    def offer_written(self, seq: PagedSequence, end: int) -> None:
        """Offer the prefix cache the rows of known tokens below `end` that a step about to launch
        writes (its drafts' rows may be rejected: never offered). Each layer writes a step's KV
        before its attention reads any, so a sequence scheduled beside this one (another choice
        of its prompt, the same prompt sent twice) can start from them in the same step."""
        self._offer_to_cache(seq, min(end, seq.num_tokens))

    def grow_all(self, spans: list[tuple[PagedSequence, int, int]]) -> bool:
        """`grow` every (sequence, start, end) if all fit together; else change nothing."""
        needed = sum(self.pages_needed(seq.pages, start, end) for seq, start, end in spans)
        if needed > self.pool.num_free:
            return False
        for seq, start, end in spans:
            self.grow(seq, start, end)
        return True

    def _release_unreachable(self, pages: SeqPages, start: int) -> None:
        dead = self._first_sliding_page(start)  # pages wholly below the lowest row anyone reads
        done = pages.sliding_released
        if dead <= done:
            return
        released = [page for page in reversed(pages.sliding[done:dead]) if page]
        if released:
            self.pool.release(released)
        pages.sliding[done:dead] = [0] * (dead - done)
        pages.sliding_released = dead

    def free(self, seq: PagedSequence, committed: int) -> None:
        """Release every page of the sequence; rows below `committed` are final and offered to the
        prefix cache first (with a window at its last boundary)."""
        pages = seq.pages
        if self.cache is not None and committed > 0:
            end = [self.cache.last_boundary(committed)]
            self._offer_to_cache(seq, committed, extra_boundaries=end)
        # Last pages first: the cache evicts the idle pages released earliest, so prefixes last.
        self.pool.release([page for page in reversed(pages.sliding) if page])
        self.pool.release(list(reversed(pages.full)))
        seq.pages = SeqPages()

    # ---- prefix caching ---------------------------------------------------------------------

    def lookup(self, seq: PagedSequence) -> CacheHit | None:
        """The cached prefix a new sequence can start from (at least its last token is computed)."""
        if self.cache is None or seq.pages.full:
            return None
        return self.cache.lookup(
            seq.token_ids, seq.num_tokens - 1, seq.pages.hashes, cache_salt=seq.cache_salt
        )

    def record_lookup(self, seq: PagedSequence, hit: CacheHit | None) -> None:
        if self.cache is not None:
            self.cache.num_queried_tokens += seq.num_tokens
            self.cache.num_hit_tokens += hit.tokens if hit is not None else 0

    @staticmethod
    def hit_pages(hit: CacheHit) -> SeqPages:
        """The page tables a sequence starting from `hit` would have (nothing is held)."""
        return SeqPages(
            full=list(hit.full_pages), sliding=[0] * hit.sliding_first + hit.sliding_pages
        )

    def idle_pages(self, hit: CacheHit | None) -> int:
        """The hit's pages that no sequence holds (they count as free until held)."""
        if hit is None:
            return 0
        return len({p for p in hit.full_pages + hit.sliding_pages if self.pool.refs[p] == 0})

    def adopt(self, seq: PagedSequence, hit: CacheHit) -> None:
        """Map a cache hit's pages into a new sequence (it resumes at hit.tokens)."""
        self.pool.hold(hit.full_pages + hit.sliding_pages)
        seq.pages = SeqPages(
            full=list(hit.full_pages),
            sliding=[0] * hit.sliding_first + list(hit.sliding_pages),
            sliding_released=hit.sliding_first,
            hashes=list(hit.hashes),
            num_cached_full=len(hit.full_pages),
            windows_done=hit.tokens,
        )

    def _offer_to_cache(self, seq: PagedSequence, committed: int, extra_boundaries=()) -> None:
        pages = seq.pages
        if self.cache is None or (committed <= pages.windows_done and not extra_boundaries):
            return  # every row below `committed` was offered (a step's second offer)
        boundaries = self.cache.boundaries(pages.windows_done, committed, seq.num_prompt)
        boundaries += [b for b in extra_boundaries if b not in boundaries]
        self.cache.register(pages, seq.token_ids, committed, boundaries, cache_salt=seq.cache_salt)
        pages.windows_done = max(pages.windows_done, committed)
