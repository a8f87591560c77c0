"""The CUDA driver API through ctypes, for the GPU-only experiments that need a call PyTorch does not
expose (`hisparse.host_vmm`, `hisparse.graph_flags`): no extra dependency, Linux with a CUDA driver.

    call("cuGraphLaunch", exec_, stream)     # raises RuntimeError naming the call and the error

Each function's argument types are declared once, in SIGNATURES, so ctypes passes 64-bit values
whole; a call of an undeclared function is refused rather than guessed at, and one the installed
driver lacks fails when called, not when the library loads (so an older driver still serves the rest).
"""
from __future__ import annotations

import ctypes
import functools

_u64, _size, _ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p

# argument types of every driver function called here (cuda.h); each returns a CUresult (int)
SIGNATURES = {
    # virtual memory (hisparse.host_vmm)
    "cuMemGetAllocationGranularity": [_ptr, _ptr, ctypes.c_int],
    "cuMemCreate": [_ptr, _size, _ptr, _u64],
    "cuMemAddressReserve": [_ptr, _size, _size, _u64, _u64],
    "cuMemMap": [_u64, _size, _size, _u64, _u64],
    "cuMemSetAccess": [_u64, _size, _ptr, _size],
    "cuMemUnmap": [_u64, _size],
    "cuMemAddressFree": [_u64, _size],
    "cuMemRelease": [_u64],
    # graphs (hisparse.graph_flags, scripts/graph_switch.py)
    "cuGraphCreate": [_ptr, ctypes.c_uint],
    "cuStreamBeginCapture_v2": [_ptr, ctypes.c_int],
    "cuStreamEndCapture": [_ptr, _ptr],
    "cuGraphDestroy": [_ptr],
    "cuGraphInstantiateWithFlags": [_ptr, _ptr, ctypes.c_ulonglong],
    "cuGraphLaunch": [_ptr, _ptr],
    "cuGraphUpload": [_ptr, _ptr],
    "cuGraphExecDestroy": [_ptr],
    # errors
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}


@functools.cache
def driver() -> ctypes.CDLL:
    """libcuda with SIGNATURES declared (loaded on first use, so importing this needs no GPU)."""
    lib = ctypes.CDLL("libcuda.so.1")
    for name, args in SIGNATURES.items():
        if hasattr(lib, name):                   # absent from this driver: AttributeError when called
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
    return lib


def error_name(result: int) -> str:
    name = ctypes.c_char_p()
    if driver().cuGetErrorName(result, ctypes.byref(name)) != 0 or name.value is None:
        return "an unknown error"
    return name.value.decode()


def call(name: str, *args) -> None:
    """driver().name(*args), raising RuntimeError if it does not return CUDA_SUCCESS."""
    if name not in SIGNATURES:
        raise ValueError(f"{name}: not a declared driver function; add its argument types to SIGNATURES")
    result = getattr(driver(), name)(*args)
    if result != 0:
        raise RuntimeError(f"{name} returned CUDA driver error {result} ({error_name(result)})")
