"""Pages of the host pool with reference counts, and the first-fit free runs they are drawn from.

A page is `page_rows` (P) consecutive host rows. A stream's private pages are allocated with count 1,
contiguous where a free run holds them all (contiguous rows stream faster over PCIe: DESIGN section
7), else from the lowest free runs; the pages of a shared prefix are counted once per holder (each
stream that extends the prefix, and whatever index keeps it); a page returns to the free runs when
its count reaches 0. A page counted more than once is shared, so read-only (`HostPool.write`).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


class FreeRuns:
    """Free ids of 0 .. size - 1 as sorted runs (start, length), handed out first-fit and merged back."""

    def __init__(self, size: int):
        self.size = size
        self.runs: list[tuple[int, int]] = [(0, size)] if size else []

    @property
    def free(self) -> int:
        return sum(length for _, length in self.runs)

    @property
    def largest(self) -> int:
        return max((length for _, length in self.runs), default=0)

    def take_run(self, n: int) -> int | None:
        """The first id of the first free run of n ids (now taken), or None (nothing taken)."""
        for i, (start, length) in enumerate(self.runs):
            if length >= n:
                self.runs[i:i + 1] = [] if length == n else [(start + n, length - n)]
                return start
        return None

    def take_any(self, n: int) -> list[tuple[int, int]] | None:
        """n free ids as runs (start, length): one run where a free run holds n (first fit), else the
        lowest free ids; None (nothing taken) when fewer than n are free."""
        start = self.take_run(n)
        if start is not None:
            return [(start, n)]
        if self.free < n:
            return None
        taken, left = [], n
        while left:
            start, length = self.runs[0]
            part = min(left, length)
            taken.append((start, part))
            self.runs[0:1] = [] if part == length else [(start + part, length - part)]
            left -= part
        return taken

    def fits_runs(self, sizes: Iterable[int]) -> bool:
        """Whether runs of these sizes, taken in this order (`take_run`), would all fit now."""
        runs = list(self.runs)
        for n in sizes:
            for i, (start, length) in enumerate(runs):
                if length >= n:
                    runs[i] = (start + n, length - n)
                    break
            else:
                return False
        return True

    def give(self, start: int, n: int) -> None:
        """Return ids start .. start + n - 1 (taken before), merged with their free neighbours."""
        runs = sorted(self.runs + [(start, n)])
        merged = [runs[0]]
        for s, length in runs[1:]:
            last_s, last_n = merged[-1]
            if last_s + last_n == s:
                merged[-1] = (last_s, last_n + length)
            else:
                merged.append((s, length))
        self.runs = merged


def as_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted distinct ids as runs (start, length) of consecutive ids."""
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return [(int(part[0]), part.size) for part in np.split(ids, breaks)]


class PageRefs:
    """Reference counts of `pages` pages, allocated from first-fit free runs (see the module docstring).
    Every call checks all its pages before it changes anything."""

    def __init__(self, pages: int):
        self.count = np.zeros(pages, dtype=np.int32)       # holders of each page, 0 free
        self.free_runs = FreeRuns(pages)

    @property
    def pages(self) -> int:
        return self.count.size

    @property
    def free(self) -> int:
        return self.free_runs.free

    def alloc(self, n: int, contiguous: bool = False) -> list[tuple[int, int]] | None:
        """n private pages (count 1), as runs (first page, pages): one run where a free run holds them,
        else (unless `contiguous`) the lowest free pages. None (nothing taken) when they do not fit."""
        if n == 0:
            return []
        if contiguous:
            start = self.free_runs.take_run(n)
            runs = None if start is None else [(start, n)]
        else:
            runs = self.free_runs.take_any(n)
        for start, length in runs or ():
            self.count[start:start + length] = 1
        return runs

    def _held(self, pages: Iterable[int], what: str) -> np.ndarray:
        """The pages as an int64 array, each one held (count >= 1) and in range, or ValueError."""
        ids = pages.astype(np.int64) if isinstance(pages, np.ndarray) else np.asarray(list(pages), dtype=np.int64)
        bad = ids[(ids < 0) | (ids >= self.pages)]
        if bad.size:
            raise ValueError(f"{what}: page {int(bad[0])} is outside the pool's pages 0..{self.pages - 1}")
        free = ids[self.count[ids] == 0]
        if free.size:
            raise ValueError(f"{what}: page {int(free[0])} is free (expected a page some stream or index holds)")
        return ids

    def share(self, pages: Iterable[int]) -> None:
        """One more holder of each page (a page listed twice gains two)."""
        ids = self._held(pages, "share")
        np.add.at(self.count, ids, 1)

    def release(self, pages: Iterable[int]) -> list[int]:
        """One holder fewer of each page (listed twice: two fewer); the pages no one holds any more go
        back to the free runs, and are returned."""
        ids = self._held(pages, "release")
        uniq, times = np.unique(ids, return_counts=True)
        over = uniq[self.count[uniq] < times]
        if over.size:
            raise ValueError(f"release: page {int(over[0])} is released more times than it is held "
                             f"({int(self.count[over[0]])})")
        self.count[uniq] -= times.astype(np.int32)
        freed = uniq[self.count[uniq] == 0]
        for start, length in as_runs(freed):
            self.free_runs.give(start, length)
        return freed.tolist()

    def refcount(self, page: int) -> int:
        return int(self.count[page])


class StreamRegions:
    """Where each open stream's units are. A stream's unit u is map row base + u (the slot map's index);
    its bytes are in the host row the page table maps that row to. Without a page table (`page_of`
    None) the map rows are the host rows: one contiguous `HostPool.alloc` region a stream. With one,
    a stream takes a first-fit run of map pages (whole pages of P rows, so page boundaries agree) and
    a host page behind each: the prefix's shared pages first (one more holder each), then private
    pages (contiguous where they fit). Every call checks before it changes anything."""

    def __init__(self, host, page_of, map_rows: int):
        self.host, self.page_of = host, page_of            # HostPool, [V / P] int32 on the device or None
        self.page_rows = host.page_rows
        self.map_runs = None if page_of is None else FreeRuns(map_rows // self.page_rows)
        self.held: dict[int, list[int]] = {}               # map base -> host pages (paged)

    @property
    def paged(self) -> bool:
        return self.page_of is not None

    def open(self, capacity: int, shared: list[int]) -> int:
        """A region of `capacity` units, its first len(shared) pages the given ones; its map base."""
        if not self.paged:
            if shared:
                raise ValueError("sharing pages needs a page table: make the cache with page_rows=P")
            return self.host.alloc(capacity)
        n = self.host.pages_for(capacity)
        if len(shared) > n:
            raise ValueError(f"{len(shared)} shared pages of {self.page_rows} rows exceed a stream of {capacity} units")
        first = self.map_runs.take_run(n)
        if first is None:
            raise MemoryError(f"the slot map cannot fit a stream of {n} pages of {self.page_rows} rows: "
                              f"{self.map_runs.free} of {self.map_runs.size} map pages are free, the largest "
                              f"run has {self.map_runs.largest} (raise map_rows)")
        try:
            self.host.share(shared)
            try:
                pages = list(shared) + self.host.alloc_pages(n - len(shared))
            except MemoryError:
                self.host.release_pages(shared)
                raise
        except (ValueError, MemoryError):
            self.map_runs.give(first, n)
            raise
        self.page_of[first:first + n] = torch.tensor(pages, dtype=torch.int32).to(self.page_of.device)
        self.held[first * self.page_rows] = pages
        return first * self.page_rows

    def close(self, base: int) -> None:
        """Give back the region at map row `base`: its host pages' holds, its map rows."""
        if not self.paged:
            self.host.release(base)
            return
        pages = self.held.pop(base)
        self.host.release_pages(pages)
        self.map_runs.give(base // self.page_rows, len(pages))

    def pages(self, base: int) -> list[int]:
        """Host pages of the region at map row `base`, in unit order (paged)."""
        return list(self.held[base])

    def fits(self, capacities: list[int], shared: list[int] | None = None) -> bool:
        """Whether regions of these capacities, opened in this order with shared[i] shared pages
        each (default none), would all fit now."""
        if not self.paged:
            return self.host.fits(capacities)
        needs = [self.host.pages_for(c) for c in capacities]
        private = sum(needs) - sum(shared or [])
        return self.map_runs.fits_runs(needs) and private <= self.host.pages.free

    def host_rows(self, base: int, first_unit: int, n: int) -> list[tuple[int, int, int]]:
        """Units first_unit .. first_unit + n - 1 of the region at `base` as runs (first unit, host row,
        rows) of consecutive host rows."""
        if not self.paged:
            return [(first_unit, base + first_unit, n)]
        pages, p, runs = self.held[base], self.page_rows, []
        unit = first_unit
        while unit < first_unit + n:
            rows = min(p - unit % p, first_unit + n - unit)
            row = pages[unit // p] * p + unit % p
            if runs and runs[-1][1] + runs[-1][2] == row:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + rows)
            else:
                runs.append((unit, row, rows))
            unit += rows
        return runs
