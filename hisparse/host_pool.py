"""Host pool: every row of every stream, in host memory (pinned when a GPU is present).

Each stream owns one contiguous region of rows: reading random rows spread over a large pool is
limited by the number of rows per second, while rows kept close together stream at full PCIe speed
(DESIGN section 7). Regions are handed out first-fit from a free list and merged back on release.
"""
from __future__ import annotations

import operator
import warnings
import weakref

import torch

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
    """`rows` [R, E] of every stream, with first-fit regions. On a GPU the rows are pinned until the
    pool goes: views of `rows` (and CUDA graphs that read it) must not outlive the pool."""

    def __init__(self, capacity_rows: int, row_elems: int, dtype: torch.dtype = torch.bfloat16,
                 pin: bool | None = None):
        capacity_rows = as_int(capacity_rows, "capacity_rows must be a positive int (host pool rows)", minimum=1)
        row_elems = as_int(row_elems, "row_elems must be a positive int (elements per row)", minimum=1)
        pin = torch.cuda.is_available() if pin is None else pin
        if pin:
            self.rows = pinned_empty(capacity_rows, row_elems, dtype)                      # [R, E]
            self._unpin = weakref.finalize(self, unpin, self.rows)   # when the pool goes, then freed
        else:
            self.rows = torch.empty(capacity_rows, row_elems, dtype=dtype)
        self._free: list[tuple[int, int]] = [(0, capacity_rows)]   # (start, length), sorted by start
        self._regions: dict[int, int] = {}                          # start -> length

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    @property
    def free_rows(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def row_bytes(self) -> int:
        return self.rows.shape[1] * self.rows.element_size()

    def alloc(self, n_rows: int) -> int:
        """Reserve `n_rows` contiguous rows; returns the first row. Nothing changes on failure."""
        n_rows = as_int(n_rows, "a host region's size must be an int")
        if n_rows <= 0:
            raise ValueError(f"a host region needs at least one row, got {n_rows}")
        for i, (start, length) in enumerate(self._free):
            if length >= n_rows:
                if length == n_rows:
                    del self._free[i]
                else:
                    self._free[i] = (start + n_rows, length - n_rows)
                self._regions[start] = n_rows
                return start
        largest = max((length for _, length in self._free), default=0)
        raise MemoryError(f"host pool cannot fit a region of {n_rows} rows: {self.free_rows} of "
                          f"{self.capacity} rows are free, the largest free region has {largest}")

    def fits(self, sizes: list[int]) -> bool:
        """Whether regions of these sizes, allocated in this order, would all fit now (first-fit, as
        `alloc`); nothing changes."""
        free = list(self._free)
        for n_rows in sizes:
            for i, (start, length) in enumerate(free):
                if length >= n_rows:
                    free[i] = (start + n_rows, length - n_rows)
                    break
            else:
                return False
        return True

    def release(self, start: int) -> None:
        if start not in self._regions:
            raise ValueError(f"no host region starts at row {start}")
        length = self._regions.pop(start)
        self._free.append((start, length))
        self._free.sort()
        merged = [self._free[0]]
        for s, n in self._free[1:]:
            last_s, last_n = merged[-1]
            if last_s + last_n == s:
                merged[-1] = (last_s, last_n + n)
            else:
                merged.append((s, n))
        self._free = merged

    def write(self, first_row: int, values: torch.Tensor) -> None:
        """Write values [n, E] (any device, the pool's dtype) into rows first_row .. first_row + n - 1."""
        first_row = as_int(first_row, "first_row must be an int (a host pool row)")
        if values.dim() != 2 or values.shape[1] != self.rows.shape[1]:
            raise ValueError(f"rows to write must be [n, {self.rows.shape[1]}], got {tuple(values.shape)}")
        if values.dtype != self.rows.dtype:      # a cast would store other bits than the caller's
            raise ValueError(f"rows to write must be {self.rows.dtype}, the pool's dtype, got {values.dtype}")
        if not 0 <= first_row <= self.capacity - values.shape[0]:
            raise ValueError(f"rows {first_row}..{first_row + values.shape[0] - 1} are outside the host "
                             f"pool of {self.capacity} rows")
        self.rows[first_row:first_row + values.shape[0]].copy_(values, non_blocking=values.is_cuda)


def release_cached_memory() -> None:
    """Give back the device and pinned host blocks PyTorch keeps cached after their tensors died.

    A host pool is registered memory, freed with its pool; other pinned tensors (staging copies)
    and the device blocks of a run stay cached by PyTorch, so call this between runs (after
    dropping the engine) before the next large allocation."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()
