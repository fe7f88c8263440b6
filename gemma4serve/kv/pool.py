"""Fixed-size KV pages of one attention type, handed out from a free list."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    pass


class PagePool:
    """Pages of one pool; page 0 is the null page, never handed out.

    A page-table entry that maps nothing points at the null page.
    """

    def __init__(self, num_pages: int, page_size: int, name: str):
        if num_pages < 2:
            raise ValueError(
                f"{name} pool needs at least 2 pages (page 0 is reserved), got {num_pages}"
            )
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._used = bytearray(num_pages)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{self.name} pool: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages) -> None:
        for p in pages:
            if p <= 0 or not self._used[p]:
                raise RuntimeError(f"{self.name} pool: double free or foreign page {p}")
            self._used[p] = 0
            self._free.append(p)
