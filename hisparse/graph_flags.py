"""Experiments on the H200's graph-count switch (README): decode graphs captured and instantiated
another way than PyTorch's.

PyTorch instantiates every captured graph itself (recent versions with auto-free-on-launch and node
priorities). On the H200, once PyTorch has captured 4 graphs in a process, the graphs it captured,
earlier ones too, replay slower (about 11% a decode step), their kernels no slower but the GPU idling
between them; a graph captured and never replayed counts too.

HISPARSE_GRAPH_FLAGS=F (an int, a sum of the driver's CUDA_GRAPH_INSTANTIATE_FLAG_* bits that
cuGraphInstantiateWithFlags takes: 1 auto-free on launch, 4 device launch, 8 use node priority; 2,
upload, only cuGraphInstantiateWithParams takes) makes the engine's decode graphs (and
benchmarks.common.throwaway_graphs) instantiate with flags F through the driver API and replay with
cuGraphLaunch instead. That launch skips PyTorch's replay prologue, which advances the random-number
offsets a graph captured (the decode loop draws none: it decodes greedily). Unset (the default):
PyTorch's own path. Found: with flags 0, 1, 4, 8 or 9 the 4th graph was as slow
(results/gpu_logs/0fc8fe55765c_graph_switch_flags.txt).

HISPARSE_GRAPH_CAPTURE=driver captures them with the driver's own stream capture instead of
torch.cuda.graph, PyTorch's allocations during it going to a torch.cuda.MemPool of the graph's own
(`DriverGraph`; instantiated with HISPARSE_GRAPH_FLAGS, default 0). Why: scripts/graph_switch.py found
that the switch follows the count of PyTorch's captures (CUDAGraph.capture_begin / capture_end, even
of nothing) and that the driver's captures do not count, so a process whose decode graphs are
captured this way, and which makes fewer than 4 captures through PyTorch, never sets it off (H200:
17.05 ms a decode step after 3 PyTorch captures, against 19.1). It does not shield a graph from the
switch: once 4 PyTorch captures have set it off, graphs the driver captured slow as much as PyTorch's
(results/README.md), so the way round it holds only while the process keeps to 3 PyTorch captures.
A graph captured this way must draw no random numbers: PyTorch 2.11 refuses (its generator finds no
capture of its own), other versions may not and would replay the same numbers. Default: torch.
"""
from __future__ import annotations

import ctypes
import os

import torch

from hisparse import cuda_driver

_FLAG_BITS = 1 | 4 | 8
FLAGS = os.environ.get("HISPARSE_GRAPH_FLAGS")
if FLAGS is not None:
    if not FLAGS.isdigit() or int(FLAGS) & ~_FLAG_BITS:
        raise ValueError(f"HISPARSE_GRAPH_FLAGS={FLAGS!r}: expected a sum of 1 (auto-free on launch), 4 (device "
                         f"launch) and 8 (node priority), as cuGraphInstantiateWithFlags takes them")
    FLAGS = int(FLAGS)
CAPTURE = os.environ.get("HISPARSE_GRAPH_CAPTURE", "torch")
if CAPTURE not in ("torch", "driver"):
    raise ValueError(f"HISPARSE_GRAPH_CAPTURE={CAPTURE!r}: expected 'torch' (torch.cuda.graph) or 'driver' "
                     f"(the driver's stream capture, hisparse.graph_flags.DriverGraph)")


def capture(fn, pool=None, how: str | None = None):
    """(replay, out): fn's CUDA work captured in a graph (out = fn()'s result, its tensors static),
    and the function that replays it on the current stream. `how` (default CAPTURE): "torch", by
    torch.cuda.graph (in memory pool `pool` if given), or "driver", by `DriverGraph` (pool must then
    be None)."""
    if (how or CAPTURE) == "driver":
        if pool is not None:
            raise ValueError("HISPARSE_GRAPH_CAPTURE=driver: each graph has a memory pool of its own, got pool="
                             f"{pool}")
        graph = DriverGraph(fn)
        return graph.replay, graph.out
    graph = new_graph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return replayer(graph), out


class DriverGraph:
    """fn's CUDA work captured by the driver's stream capture (cuStreamBeginCapture, global mode) on a
    stream of its own, PyTorch's allocations meanwhile in a torch.cuda.MemPool that lives as long as
    this object, and instantiated with FLAGS (None: 0). `out` is fn's result; `replay()` launches the
    graph on the current stream. Work fn forks to other streams must join the capturing one, as with
    torch.cuda.graph."""

    def __init__(self, fn):
        self.exec_ = ctypes.c_void_p()           # first, so that __del__ finds it whatever fails below
        self.pool, stream, graph = torch.cuda.MemPool(), torch.cuda.Stream(), ctypes.c_void_p()
        torch.cuda.synchronize()
        handle = ctypes.c_void_p(stream.cuda_stream)
        with torch.cuda.use_mem_pool(self.pool), torch.cuda.stream(stream):
            cuda_driver.call("cuStreamBeginCapture_v2", handle, 0)
            try:
                self.out = fn()
            except BaseException:                # the stream leaves capture mode, its graph dropped
                if cuda_driver.driver().cuStreamEndCapture(handle, ctypes.byref(graph)) == 0 and graph.value:
                    cuda_driver.driver().cuGraphDestroy(graph)
                raise
            cuda_driver.call("cuStreamEndCapture", handle, ctypes.byref(graph))
        try:
            cuda_driver.call("cuGraphInstantiateWithFlags", ctypes.byref(self.exec_), graph, FLAGS or 0)
        finally:                                 # unchecked: an instantiation error is the one to raise
            cuda_driver.driver().cuGraphDestroy(graph)

    def replay(self) -> None:
        cuda_driver.call("cuGraphLaunch", self.exec_, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))

    def __del__(self) -> None:
        if self.exec_.value:
            cuda_driver.driver().cuGraphExecDestroy(self.exec_)


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph to capture into: one PyTorch keeps the captured graph of when FLAGS is set."""
    return torch.cuda.CUDAGraph(keep_graph=True) if FLAGS is not None else torch.cuda.CUDAGraph()


def replayer(graph: torch.cuda.CUDAGraph):
    """The function that replays captured `graph` on the current stream: graph.replay, or with FLAGS
    set a launch of the graph instantiated with those flags (destroyed with the returned function)."""
    if FLAGS is None:
        return graph.replay
    exec_ = ctypes.c_void_p()
    cuda_driver.call("cuGraphInstantiateWithFlags", ctypes.byref(exec_), ctypes.c_void_p(graph.raw_cuda_graph()),
                     FLAGS)

    class Replay:
        def __call__(self) -> None:
            cuda_driver.call("cuGraphLaunch", exec_, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))

        def __del__(self) -> None:
            cuda_driver.driver().cuGraphExecDestroy(exec_)

    replay = Replay()
    replay.graph = graph                    # the captured graph (and its memory pool) lives as long
    return replay
