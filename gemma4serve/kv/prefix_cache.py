"""Prefix caching over the arena: full-layer pages by content, sliding pages by window.

A full-layer page is keyed by a hash chained over the token ids of every full page up to and
including it (rooted in the model and dtype, and in the request's cache salt if it has one), so
equal keys mean equal KV, and a salted request shares pages only with requests of its salt.
Sliding layers only need the window before the first new token, so at cacheable boundaries b the
cache keeps the sliding pages that cover [b - keep, b), keyed by the chain hash at b: a hit at b
needs the full pages below b and that one window, however many windows long the prefix is.
Boundaries are multiples of both page lengths, so a sequence resuming at b never writes into a
shared page.

The cache claims pages; sequences hold them. An unheld claimed page is idle and is evicted least
recently used first when the arena needs pages (`PagePool`); a held page is never evicted.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass

from gemma4serve.kv.pool import PagePool


@dataclass
class Window:
    """The sliding pages that cover the rows [tokens - keep, tokens) of a cached prefix."""

    tokens: int  # the boundary
    sliding_first: int  # logical sliding page of the window's first row
    sliding_pages: list[int]


@dataclass
class CacheHit:
    tokens: int  # the prefix length served from the cache (a boundary)
    full_pages: list[int]  # the full-layer pages of positions [0, tokens)
    sliding_first: int  # logical sliding page of the window's first row
    sliding_pages: list[int]  # the sliding pages from there up to `tokens`
    hashes: list[bytes]  # the chain hashes of full_pages


class PrefixCache:
    def __init__(
        self,
        pool: PagePool,
        *,
        full_page_tokens: int,
        sliding_page_tokens: int,
        sliding_keep: int,
        model_key: str,  # what the cached KV depends on besides the tokens (model, dtype)
        window_interval: int,
    ):
        self.pool = pool
        self.full_page_tokens = full_page_tokens
        self.sliding_page_tokens = sliding_page_tokens
        self.sliding_keep = sliding_keep
        self.boundary = math.lcm(full_page_tokens, sliding_page_tokens)  # cacheable positions
        # Windows are kept at multiples of this inside long sequences (besides prompt and end).
        self.window_interval = -(-window_interval // self.boundary) * self.boundary
        self.root = hashlib.blake2b(model_key.encode(), digest_size=16).digest()
        self.full: dict[bytes, int] = {}  # chain hash -> physical full page
        self.hash_of_page: dict[int, bytes] = {}
        self.windows: dict[bytes, Window] = {}  # chain hash at a boundary -> its window
        self.windows_of_page: dict[int, set[bytes]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        pool.evict = self._evict

    # ---- lookup -----------------------------------------------------------------------------

    def chain(
        self, token_ids: list[int], num_pages: int, known: list[bytes], cache_salt: str | None
    ) -> None:
        """Extend `known` (the chain hashes computed already) to at least the first `num_pages`
        full pages' (in place: a copy each step would cost a long sequence's whole chain)."""
        size = self.full_page_tokens
        while len(known) < num_pages:
            i = len(known)
            parent = known[-1] if known else self._root(cache_salt)
            page = array("q", token_ids[i * size : (i + 1) * size]).tobytes()
            known.append(hashlib.blake2b(parent + page, digest_size=16).digest())

    def _root(self, cache_salt: str | None) -> bytes:
        if not cache_salt:
            return self.root
        # its own hash domain, so that no salt's root can equal a page's chain hash
        salted = self.root + cache_salt.encode()
        return hashlib.blake2b(salted, digest_size=16, person=b"salt").digest()

    def lookup(
        self, token_ids: list[int], limit: int, known: list[bytes], *, cache_salt: str | None
    ) -> CacheHit | None:
        """The longest cached prefix of at most `limit` tokens, or None. `known`: the chain
        hashes computed already (extended in place, so a waiting prompt is hashed once)."""
        self.chain(token_ids, limit // self.full_page_tokens, known, cache_salt)
        hashes = known[: limit // self.full_page_tokens]
        matched = 0
        while matched < len(hashes) and hashes[matched] in self.full:
            matched += 1
        for i in range(matched, 0, -1):
            window = self.windows.get(hashes[i - 1])
            if window is not None:
                full = [self.full[h] for h in hashes[:i]]
                hit = CacheHit(
                    window.tokens, full, window.sliding_first, window.sliding_pages, hashes[:i]
                )
                return hit
        return None

    # ---- registration -----------------------------------------------------------------------

    def register(
        self,
        pages,
        token_ids: list[int],
        committed: int,
        boundaries: list[int],
        *,
        cache_salt: str | None,
    ) -> None:
        """Cache a sequence's full pages wholly below `committed` (rows whose KV is final) and its
        windows at `boundaries` (each <= committed) while their sliding pages are mapped.
        `pages` is the sequence's SeqPages (its chain hashes and cached count are kept there)."""
        num_full = min(committed // self.full_page_tokens, len(pages.full))
        self.chain(token_ids, num_full, pages.hashes, cache_salt)
        hashes = pages.hashes  # read below num_full only (a lookup may have hashed further)
        for i in range(pages.num_cached_full, num_full):
            page, key = pages.full[i], hashes[i]
            if key not in self.full and page not in self.hash_of_page:
                self.full[key] = page
                self.hash_of_page[page] = key
                self.pool.claim(page)
        pages.num_cached_full = max(pages.num_cached_full, num_full)
        for b in boundaries:
            if b // self.full_page_tokens > num_full or b == 0:
                continue
            key = hashes[b // self.full_page_tokens - 1]
            if key in self.windows:
                continue
            first = max(0, b - self.sliding_keep) // self.sliding_page_tokens
            window = pages.sliding[first : b // self.sliding_page_tokens]
            if not window or 0 in window:
                continue
            self.windows[key] = Window(b, first, list(window))
            for page in window:
                self.windows_of_page.setdefault(page, set()).add(key)
                self.pool.claim(page)

    def boundaries(self, start: int, end: int, prompt_end: int) -> list[int]:
        """The window boundaries in (start, end]: multiples of the interval, and the last boundary
        of the prompt (a later request with the same prompt resumes there)."""
        out = []
        step = self.window_interval
        b = (start // step + 1) * step
        while b <= end:
            out.append(b)
            b += step
        last_of_prompt = (prompt_end - 1) // self.boundary * self.boundary
        if start < last_of_prompt <= end and last_of_prompt not in out:
            out.append(last_of_prompt)
        return out

    def last_boundary(self, end: int) -> int:
        return end // self.boundary * self.boundary

    # ---- eviction ---------------------------------------------------------------------------

    def _evict(self, page: int) -> None:
        key = self.hash_of_page.pop(page, None)
        if key is not None:
            del self.full[key]
            self.pool.unclaim(page)
        for window_key in list(self.windows_of_page.get(page, ())):
            self._drop_window(window_key)

    def _drop_window(self, key: bytes) -> None:
        for page in self.windows.pop(key).sliding_pages:
            keys = self.windows_of_page[page]
            keys.discard(key)
            if not keys:
                del self.windows_of_page[page]
            self.pool.unclaim(page)

    def clear(self) -> None:
        """Drop every entry: idle pages return to the free list."""
        for page in list(self.hash_of_page):
            self._evict(page)
        for key in list(self.windows):
            self._drop_window(key)
