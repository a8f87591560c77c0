"""hisparse.cuda_driver's checks, on any machine: a fake driver stands in for libcuda."""
import ctypes

import pytest

from hisparse import cuda_driver


class FakeDriver:
    """Returns `result` from every call; names error 2 as cuda.h does."""
    def __init__(self, result: int):
        self.result, self.calls = result, []

    def __getattr__(self, name):
        def fn(*args):
            self.calls.append(name)
            if name == "cuGetErrorName":
                args[1]._obj.value = b"CUDA_ERROR_OUT_OF_MEMORY" if args[0] == 2 else None
                return 0 if args[0] == 2 else 1
            return self.result
        return fn


def test_call_refuses_an_undeclared_function_before_calling_anything(monkeypatch):
    fake = FakeDriver(0)
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    with pytest.raises(ValueError, match="cuMemAlloc: not a declared driver function"):
        cuda_driver.call("cuMemAlloc", 0)
    assert fake.calls == []


def test_call_raises_with_the_function_and_the_error_name(monkeypatch):
    monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver(2))
    with pytest.raises(RuntimeError, match=r"cuMemRelease returned CUDA driver error 2 \(CUDA_ERROR_OUT_OF_MEMORY\)"):
        cuda_driver.call("cuMemRelease", 0)
    monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver(999))
    with pytest.raises(RuntimeError, match=r"error 999 \(an unknown error\)"):
        cuda_driver.call("cuMemRelease", 0)
    fake = FakeDriver(0)
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    cuda_driver.call("cuGraphLaunch", ctypes.c_void_p(), ctypes.c_void_p())
    assert fake.calls == ["cuGraphLaunch"]


def test_driver_declares_every_signature_and_skips_what_the_library_lacks(monkeypatch):
    """driver() loads libcuda.so.1, gives each declared function its argument types and an int result,
    and leaves out one the installed driver does not have (an older driver still serves the rest)."""
    import types
    missing = "cuGraphUpload"

    class FakeLib:
        def __init__(self, path):
            assert path == "libcuda.so.1"
            for name in cuda_driver.SIGNATURES:
                if name != missing:
                    setattr(self, name, types.SimpleNamespace())

    monkeypatch.setattr(ctypes, "CDLL", FakeLib)
    cuda_driver.driver.cache_clear()
    try:
        lib = cuda_driver.driver()
        for name, args in cuda_driver.SIGNATURES.items():
            if name != missing:
                assert getattr(lib, name).argtypes == args and getattr(lib, name).restype is ctypes.c_int, name
        assert not hasattr(lib, missing)
    finally:
        cuda_driver.driver.cache_clear()
