"""An experiment on the H200's graph-count switch (README): decode graphs instantiated with chosen flags.

PyTorch instantiates every captured graph itself (recent versions with auto-free-on-launch and node
priorities). On the H200 a process's 4th graph and every later one replayed about 11% slower, its
kernels no slower but the GPU idling between them, and a graph captured and instantiated, never
replayed, counts too. HISPARSE_GRAPH_FLAGS=F (an int, a sum of the driver's CUDA_GRAPH_INSTANTIATE_FLAG_* bits that
cuGraphInstantiateWithFlags takes: 1 auto-free on launch, 4 device launch, 8 use node priority; 2,
upload, only cuGraphInstantiateWithParams takes) makes the engine's decode graphs (and
benchmarks.common.throwaway_graphs) instantiate with flags F through the driver API and replay with
cuGraphLaunch instead. That launch skips PyTorch's replay prologue, which advances the random-number
offsets a graph captured (the decode loop draws none: it decodes greedily). Unset (the default):
PyTorch's own path. Found: with flags 0, 1, 4, 8 or 9 the 4th graph was as slow
(results/gpu_logs/0fc8fe55765c_graph_switch_flags.txt).
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
