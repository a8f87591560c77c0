"""Test setup: the `gpu` marker, and how pytest-xdist divides the suite.

Without a GPU the kernels run in Triton's interpreter: `kernels_triton` makes that choice, for the tests
as for every entry point; it is imported here first, before any test module imports triton.

Under pytest-xdist (the README's `-n auto --dist loadgroup`: the interpreter is single-threaded
Python, so workers on separate cores divide the suite's time), each test file runs in one worker,
whose module-level caches (a tiny model, its resident run) then serve all of that file's tests, and
the GPU-marked tests in one worker of their own. On a machine with a GPU every test goes to that one
worker (the others run on the GPU too), so no two share the GPU at once. Each worker takes its share
of torch's threads. The groups reach xdist's scheduler through `pytest_xdist_make_scheduler` below
(pytest 9 keeps the nodeid suffix by which xdist 3.8 passes them on from taking effect).
"""
import os

import pytest
import torch

import kernels_triton  # noqa: F401  the interpreter choice, before any test module imports triton

HAS_GPU = torch.cuda.is_available()

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))


# The files that take longest in the interpreter, longest first: under --dist loadgroup a worker takes
# one whole file at a time, so these start first (longest-first packing) rather than last, where
# xdist's own order (most tests first) put them and the suite waited on the one worker running them.
SLOW_FILES = ("test_benchmarks.py", "test_engine_nsa.py", "test_engine_quest.py", "test_nsa.py", "test_sweep.py",
              "test_engine_dsa.py", "test_prefill.py", "test_serving.py", "test_dsa_fp8.py", "test_serving_hybrid.py",
              "test_serving_overlap.py", "test_figures.py", "test_resolve.py", "test_notebooks.py",
              "test_serving_staged.py")


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False      # the groups in the items' order, set below


def xdist_group_of(nodeid: str) -> str:
    """The group of a test by its nodeid: the suffix "@group" that xdist adds for its xdist_group mark
    where it can (pytest < 9), else as set below: "gpu" with a GPU, the test's file without one (there
    the GPU-marked tests are skipped, wherever they go)."""
    at = nodeid.rfind("@")
    if at > nodeid.rfind("]"):          # past a parameter id, which may hold an "@"
        return nodeid[at + 1:]
    return "gpu" if HAS_GPU else nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


@pytest.hookimpl(tryfirst=True)         # before xdist's own, which would make its LoadGroupScheduling
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by the groups of `xdist_group_of`. xdist 3.8 reads a test's group from a suffix
    it sets on the nodeid (`item._nodeid`), which pytest 9's Node.nodeid (read from Node._id) never
    shows: its scheduler then saw one group per test and spread each file over the workers, every
    worker building the file's module caches (tiny models, resident runs) again."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return FileGroupScheduling(config, log)


@pytest.hookimpl(tryfirst=True)         # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:          # --dist loadgroup: one worker per group
            group = "gpu" if HAS_GPU or item.get_closest_marker("gpu") else item.path.name
            item.add_marker(pytest.mark.xdist_group(group))
        # SLOW_FILES first, then the other files by number of tests (xdist's own order); stable
        per_file = {}
        for item in items:
            per_file[item.path.name] = per_file.get(item.path.name, 0) + 1

        def rank(item):
            name = item.path.name
            return (SLOW_FILES.index(name), 0) if name in SLOW_FILES else (len(SLOW_FILES), -per_file[name])
        items.sort(key=rank)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run benchmarks/gpu_suite.sh on one)")
    for item in items:
        if item.get_closest_marker("gpu"):
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
