"""Test setup: Triton's interpreter when no GPU is present, and the `gpu` marker.

`@triton.jit` decides between interpreter and compiler when a kernel module is imported, so the
switch must happen here, before any test module imports `kernels_triton`.
"""
import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_suite.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_GPU else "cpu")


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float tensor from torch.empty starts as NaN (ints as -7), so an element no kernel
    writes fails the comparison."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one thread is many times faster than two on the shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
