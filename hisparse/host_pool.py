"""Host pool: every row of every stream, in host memory (pinned when a GPU is present).

Rows are handed out in pages of `page_rows` (P) rows with reference counts (`hisparse.host_pages`):
a contiguous region (`alloc`, one stream's rows when no page table is used), or pages (`alloc_pages`,
contiguous where they fit) that streams extending one prefix share (`share`) and give back
(`release_pages`). Reading random rows spread over a large pool is limited by the number of rows per
second, while rows kept close together stream at full PCIe speed (DESIGN section 7): hence first-fit
runs. A page held more than once is shared and read-only: `write` refuses its rows.
"""
from __future__ import annotations

import gc
import operator
import warnings
import weakref

import numpy as np
import torch

from hisparse.host_pages import PageRefs

# cudaHostRegister flags: pinned for every context (portable), and mapped into the device's address
# space, so kernels read it zero-copy through the host pointer
_REGISTER_PORTABLE_MAPPED = 1 | 2


def pinned_empty(rows: int, row_elems: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, row_elems] host tensor, page-locked with cudaHostRegister.

    Not `torch.empty(..., pin_memory=True)`: PyTorch's pinned allocator rounds each block up to a
    power of two, so an 88 GiB pool would ask for 128 GiB (out of memory on a 128 GiB machine).
    The caller unregisters it (`unpin`) before the last reference goes."""
    if not torch.cuda.is_available():
        raise RuntimeError("pinning a host pool needs a CUDA GPU; pass pin=False on a CPU-only machine")
    t = torch.empty(rows, row_elems, dtype=dtype)
    nbytes = t.untyped_storage().nbytes()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _REGISTER_PORTABLE_MAPPED)
    if int(err) != 0:
        raise MemoryError(f"could not pin a host pool of {nbytes / 2**30:.1f} GiB ({rows} rows x "
                          f"{row_elems} elements): cudaHostRegister returned {err}")
    return t


def unpin(t: torch.Tensor) -> None:
    """Unregister a `pinned_empty` tensor (registered memory is pinned for every device: wait for
    all of them)."""
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)      # no kernel or copy in flight may still read or write it
    err = torch.cuda.cudart().cudaHostUnregister(t.untyped_storage().data_ptr())
    if int(err) != 0:
        warnings.warn(f"cudaHostUnregister of a host pool returned {err}", RuntimeWarning, stacklevel=2)


def as_int(value, expected: str, minimum: int | None = None) -> int:
    """value as a Python int (numpy and 0-d torch integers included, not bools or floats), or
    ValueError(f"{expected}, got {value!r}"), also when it is below `minimum`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{expected}, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{expected}, got {value!r}")
    return number


class HostPool:
    """`rows` [R, E] of every stream, in counted pages of `page_rows` rows (a power of two dividing R).
    On a GPU the rows are pinned until the pool goes: views of `rows` (and CUDA graphs that read it)
    must not outlive the pool."""

    def __init__(self, capacity_rows: int, row_elems: int, dtype: torch.dtype = torch.bfloat16,
                 pin: bool | None = None, page_rows: int = 1):
        capacity_rows = as_int(capacity_rows, "capacity_rows must be a positive int (host pool rows)", minimum=1)
        row_elems = as_int(row_elems, "row_elems must be a positive int (elements per row)", minimum=1)
        page_rows = as_int(page_rows, "page_rows must be a positive int (rows a page)", minimum=1)
        if page_rows & (page_rows - 1) or capacity_rows % page_rows:
            raise ValueError(f"page_rows={page_rows}: expected a power of two that divides the pool's "
                             f"{capacity_rows} rows")
        pin = torch.cuda.is_available() if pin is None else pin
        if pin:
            self.rows = pinned_empty(capacity_rows, row_elems, dtype)                      # [R, E]
            self._unpin = weakref.finalize(self, unpin, self.rows)   # when the pool goes, then freed
        else:
            self.rows = torch.empty(capacity_rows, row_elems, dtype=dtype)
        self.page_rows = page_rows
        self.pages = PageRefs(capacity_rows // page_rows)
        self._regions: dict[int, int] = {}          # first row -> pages, of each `alloc` region

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @property
    def free_rows(self) -> int:
        return self.pages.free * self.page_rows

    def pages_for(self, n_rows: int) -> int:
        """Pages that hold n_rows rows."""
        return -(-n_rows // self.page_rows)

    @property
    def row_bytes(self) -> int:
        return self.rows.shape[1] * self.rows.element_size()

    def alloc(self, n_rows: int) -> int:
        """Reserve `n_rows` contiguous rows (whole pages, first fit, private); returns the first row.
        Nothing changes on failure."""
        n_rows = as_int(n_rows, "a host region's size must be an int")
        if n_rows <= 0:
            raise ValueError(f"a host region needs at least one row, got {n_rows}")
        runs = self.pages.alloc(self.pages_for(n_rows), contiguous=True)
        if runs is None:
            raise MemoryError(f"host pool cannot fit a region of {n_rows} rows: {self.free_rows} of "
                              f"{self.capacity} rows are free, the largest free region has "
                              f"{self.pages.free_runs.largest * self.page_rows}")
        (first, pages), = runs
        self._regions[first * self.page_rows] = pages
        return first * self.page_rows

    def fits(self, sizes: list[int]) -> bool:
        """Whether regions of these sizes (rows), allocated in this order, would all fit now (first
        fit, as `alloc`); nothing changes."""
        return self.pages.free_runs.fits_runs(self.pages_for(n) for n in sizes)

    def release(self, start: int) -> None:
        """Give back the region `alloc` returned as `start` (its pages that nothing else holds)."""
        if start not in self._regions:
            raise ValueError(f"no host region starts at row {start}")
        first = start // self.page_rows
        self.pages.release(np.arange(first, first + self._regions.pop(start)))

    def alloc_pages(self, n: int) -> list[int]:
        """n private pages (count 1): one contiguous run where one fits, else the lowest free pages.
        Page p is rows p * page_rows .. (p + 1) * page_rows - 1. Nothing changes on failure."""
        n = as_int(n, "a number of pages must be an int >= 0", minimum=0)
        runs = self.pages.alloc(n)
        if runs is None:
            raise MemoryError(f"host pool cannot fit {n} pages of {self.page_rows} rows: {self.pages.free} of "
                              f"{self.pages.pages} pages are free")
        return [p for first, length in runs for p in range(first, first + length)]

    def share(self, pages: list[int]) -> None:
        """One more holder of each page (held already): shared, the pages are read-only."""
        self.pages.share(pages)

    def release_pages(self, pages: list[int]) -> list[int]:
        """One holder fewer of each page; returns those now free."""
        return self.pages.release(pages)

    def refcount(self, page: int) -> int:
        return self.pages.refcount(as_int(page, "a page must be an int"))

    def check_writable(self, first_row: int, n_rows: int) -> None:
        """ValueError if any of rows first_row .. first_row + n_rows - 1 lies on a shared page."""
        first, last = first_row // self.page_rows, (first_row + n_rows - 1) // self.page_rows
        counts = self.pages.count[first:last + 1]
        if (counts > 1).any():
            page = first + int((counts > 1).argmax())
            raise ValueError(f"rows {first_row}..{first_row + n_rows - 1} reach page {page} (rows "
                             f"{page * self.page_rows}..{(page + 1) * self.page_rows - 1}), held "
                             f"{int(counts[page - first])} times: a shared page is read-only (a prefix's page "
                             f"is written once, before it is shared)")

    def write(self, first_row: int, values: torch.Tensor) -> None:
        """Write values [n, E] (any device, the pool's dtype) into rows first_row .. first_row + n - 1,
        none of them on a shared page."""
        first_row = as_int(first_row, "first_row must be an int (a host pool row)")
        if values.dim() != 2 or values.shape[1] != self.rows.shape[1]:
            raise ValueError(f"rows to write must be [n, {self.rows.shape[1]}], got {tuple(values.shape)}")
        if values.dtype != self.rows.dtype:      # a cast would store other bits than the caller's
            raise ValueError(f"rows to write must be {self.rows.dtype}, the pool's dtype, got {values.dtype}")
        if not 0 <= first_row <= self.capacity - values.shape[0]:
            raise ValueError(f"rows {first_row}..{first_row + values.shape[0] - 1} are outside the host "
                             f"pool of {self.capacity} rows")
        if values.shape[0]:
            self.check_writable(first_row, values.shape[0])
        self.rows[first_row:first_row + values.shape[0]].copy_(values, non_blocking=values.is_cuda)


def release_cached_memory() -> None:
    """Give back the device and pinned host blocks PyTorch keeps cached after their tensors died.

    A host pool is registered memory, freed with its pool; other pinned tensors (staging copies)
    and the device blocks of a run stay cached by PyTorch, so call this between runs (after
    dropping the engine) before the next large allocation."""
    gc.collect()                  # a pool in a reference cycle unpins (its finalizer) only when collected
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()
