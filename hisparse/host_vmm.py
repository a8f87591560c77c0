"""Pinned host memory from the CUDA driver's virtual memory API (cuMemCreate), for the host pool.

cudaHostRegister pins memory the process already has, and the GPU maps it page by page whatever the
CPU's page size; cuMemCreate of a host location makes the allocation itself, in chunks of the
driver's granularity, and maps it at one address for CPU and GPU. Whether the GPU then reaches
random rows of a many-GiB pool with fewer translation misses is what scripts/copy_interference.py
--vmm measures: on the H200 it does not (a 12 GiB pool at 2 MiB granularity slowed the kernels beside the
copy as much as a registered one: results/gpu_logs/e9882268f059_copy_interference_span_vmm.txt).
Linux with a CUDA driver only; the driver API through ctypes (`hisparse.cuda_driver`).
"""
from __future__ import annotations

import ctypes

import torch

from hisparse.cuda_driver import call as _call

# cuda.h's values
_HOST, _HOST_NUMA = 2, 3                      # CUmemLocationType
_PINNED = 1                                   # CU_MEM_ALLOCATION_TYPE_PINNED
_READ_WRITE = 3                               # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_DEVICE = 1                                   # CU_MEM_LOCATION_TYPE_DEVICE
_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):      # CUmemAllocationProp: 32 bytes
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", _Location),
                ("win32_metadata", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("rdma_capable", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


# start address -> (bytes, allocation handle, location type, granularity) of every live mapping
_mappings: dict[int, tuple[int, int, int, int]] = {}


def _gpu_numa_node(device: int) -> int:
    """The host NUMA node the GPU hangs off (sysfs), 0 where the system does not say."""
    try:
        props = torch.cuda.get_device_properties(device)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return max(0, int(f.read()))
    except (AttributeError, OSError, ValueError):        # an older torch, or no such file
        return 0


def host_empty(rows: int, row_elems: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, row_elems] tensor of pinned host memory made by cuMemCreate and mapped
    read-write for the CPU and the current GPU (only) at one address (kernels read it zero-copy). Its size
    is rounded up to the driver's recommended granularity. Free it with `free` (host_pool.unpin does)
    before the last reference goes."""
    torch.cuda.synchronize()                  # the runtime's context made and current on this thread
    device = torch.cuda.current_device()
    nbytes = rows * row_elems * dtype.itemsize
    errors = []
    # a host location with no NUMA node (newer drivers), else the GPU's own node
    for location in (_Location(_HOST, 0), _Location(_HOST_NUMA, _gpu_numa_node(device))):
        prop = _AllocationProp(type=_PINNED, location=location)
        granularity = ctypes.c_size_t()
        handle = ctypes.c_uint64()
        try:
            _call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop),
                  _GRANULARITY_RECOMMENDED)
            size = -(-nbytes // granularity.value) * granularity.value
            _call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
            break
        except RuntimeError as e:
            errors.append(f"location type {location.type}: {e}")
    else:
        raise MemoryError(f"could not allocate {nbytes / 2**30:.2f} GiB of host memory with cuMemCreate: "
                          + "; ".join(errors))
    start = ctypes.c_uint64()
    try:
        _call("cuMemAddressReserve", ctypes.byref(start), size, granularity.value, 0, 0)
        try:
            _call("cuMemMap", start.value, size, 0, handle.value, 0)
            access = (_AccessDesc * 2)(_AccessDesc(_Location(_DEVICE, device), _READ_WRITE),
                                       _AccessDesc(location, _READ_WRITE))
            try:
                _call("cuMemSetAccess", start.value, size, access, 2)
            except RuntimeError:
                _call("cuMemUnmap", start.value, size)
                raise
        except RuntimeError:
            _call("cuMemAddressFree", start.value, size)
            raise
    except RuntimeError:
        _call("cuMemRelease", handle.value)
        raise
    _mappings[start.value] = (size, handle.value, location.type, granularity.value)
    buffer = (ctypes.c_uint8 * nbytes).from_address(start.value)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(rows, row_elems)


def is_mapped(t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() in _mappings


def mapping(t: torch.Tensor) -> dict:
    """How `t`'s memory was made: bytes mapped, location ('host' or 'host_numa'), granularity."""
    size, _, location, granularity = _mappings[t.untyped_storage().data_ptr()]
    return {"bytes": size, "location": {_HOST: "host", _HOST_NUMA: "host_numa"}[location],
            "granularity": granularity}


def free(t: torch.Tensor) -> None:
    """Unmap and release a `host_empty` tensor's memory; no kernel may be reading it (synchronize
    first), and nothing may touch `t` or its views afterwards."""
    start = t.untyped_storage().data_ptr()
    if start not in _mappings:
        raise ValueError(f"no cuMemCreate mapping starts at {start:#x}: not a host_empty tensor, or freed already")
    size, handle, _, _ = _mappings[start]
    _call("cuMemUnmap", start, size)
    _call("cuMemAddressFree", start, size)
    _call("cuMemRelease", handle)
    del _mappings[start]
