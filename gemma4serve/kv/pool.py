"""The arena's pages: handed out from a free list, shared by reference count.

Page 0 is the null page: never handed out, so a page-table entry that maps nothing points at it.
A page is free, held (by one or more sequences), or idle: no sequence holds it but the prefix cache
still claims it, so a later request can take it back. Idle pages count as available: when the free
list runs short, `allocate` asks the cache to evict the least recently used ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class OutOfPages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(
                f"the KV arena needs at least 2 pages (page 0 is reserved), got {num_pages}"
            )
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self.refs = [0] * num_pages  # sequences holding each page
        self.claimed = [0] * num_pages  # prefix-cache entries claiming each page
        self.idle: OrderedDict[int, None] = OrderedDict()  # claimed, unheld; oldest first
        # Called with a page to evict: the cache drops every claim on it (and on its entries'
        # other pages), returning each page whose claims end through `unclaim`.
        self.evict: Callable[[int], None] | None = None

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages no sequence holds: free, or idle in the prefix cache (evicted on demand)."""
        return len(self._free) + len(self.idle)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"KV arena: asked for {n} pages, {self.num_free} available")
        while len(self._free) < n:
            self.evict(next(iter(self.idle)))
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self.refs[page] = 1
        return pages

    def hold(self, pages) -> None:
        """One more sequence reads `pages` (prefix-cache hits)."""
        for page in pages:
            if self.refs[page] == 0:
                if page not in self.idle:
                    raise RuntimeError(f"KV arena: page {page} is neither held nor cached")
                del self.idle[page]
            self.refs[page] += 1

    def release(self, pages) -> None:
        """A sequence lets go of `pages`: unheld pages become idle if cached, else free."""
        for page in pages:
            if page <= 0 or self.refs[page] <= 0:
                raise RuntimeError(f"KV arena: double free or foreign page {page}")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self._park(page)

    def claim(self, page: int) -> None:
        """The prefix cache keeps `page` (held by the sequence that wrote it)."""
        self.claimed[page] += 1

    def unclaim(self, page: int) -> None:
        self.claimed[page] -= 1
        if self.claimed[page] == 0 and self.refs[page] == 0:
            del self.idle[page]
            self._free.append(page)

    def _park(self, page: int) -> None:
        if self.claimed[page]:
            self.idle[page] = None  # most recently used last
        else:
            self._free.append(page)
