"""The graph-count switch in its smallest form: does a process's N-th CUDA graph replay slower? GPU only.

    python -m scripts.graph_switch [--graphs 6] [--kernels 4000] [--kind add] [--free] [--upload]
                                   [--before 0 --before-how uninstantiated] [--capture-stream shared]
                                   [--capture-mode global] [--replay-stream current]

On the H200 a process's 4th decode graph and every later one replayed about 11% slower than its
first three, the kernels no slower but the GPU idling between them (scripts/repeat_runs.py, README).
This script makes --graphs graphs of --kernels small kernels each (launch-bound, so a longer wait
between kernels shows at once) and after making each one times its replay and again the first
graph's: is a graph slow for being made late (its own replay slow, the first one's not), or is
every graph slow once the process has made enough (both)?
--kind: `add`, PyTorch's in-place add on 1024 floats; `triton`, a Triton kernel doing the same;
`matmul`, cuBLAS on [16, 1024] by [1024, 1024] in bf16; `mixed`, those three in turn; `alloc`,
out-of-place adds, each result a new block of the graph's memory pool; `args`, the Triton kernel
with 23 more pointer arguments (as many as the resolve has); `distinct`, 32 compilations of it in turn.
--free frees each graph but the first once timed (do freed graphs count?); --upload hands each
graph to the driver's cuGraphUpload right after its instantiation; --before N first makes N graphs
and frees them (--before-how: which kind of making counts?); --capture-stream, --capture-mode and
--replay-stream change where and how graphs are captured and replayed.
Each figure is the median of --replays replays, in ms, and per kernel in us.

Found on the H200 (results/gpu_logs/28e3b17dcb64_graph_switch_pytorch_capture.txt): with `args`,
`distinct` or `alloc` kernels every graph, graph 1 too, takes +0.18 us a kernel from the 4th graph on
(`add`, `triton`, `matmul` do not show it); PyTorch's captures count (3 empty ones, or capture_begin /
capture_end alone, do it; the driver's or the runtime's own captures, cuGraphCreate, empty_cache or a
MemPool do not). Graphs the driver captured (--capture-how driver) run fast while the process has made
at most 3 PyTorch captures, and slow like the rest once 4 have set the switch off (`--capture-how
driver --before 4 --before-how empty`; results/gpu_logs/595b4d5e2b02_gpu_tests_graph_switch_driver.txt).
"""
import argparse
import ctypes
import itertools
import os
import statistics

import torch
import triton
import triton.language as tl

from hisparse import cuda_driver, graph_flags


@triton.jit
def _add_one_kernel(x_ptr, N: tl.constexpr, SALT: tl.constexpr = 0):
    o = tl.arange(0, N)
    tl.store(x_ptr + o, tl.load(x_ptr + o) + 1 + SALT * 0)


@triton.jit
def _add_one_many_args_kernel(x_ptr, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16,
                              a17, a18, a19, a20, a21, a22, a23, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(x_ptr + o, tl.load(x_ptr + o) + 1)


def kernel_chain(kind: str):
    """The function that launches one kernel of `kind` (see --kind), with its tensors."""
    x = torch.zeros(1024, device="cuda")
    a = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
    args = [torch.zeros(1, device="cuda") for _ in range(23)]
    salts = itertools.cycle(range(32))
    launches = {"add": lambda: x.add_(1), "triton": lambda: _add_one_kernel[(1,)](x, 1024),
                "matmul": lambda: torch.matmul(a, w, out=out),
                "alloc": lambda: x + 1,
                "args": lambda: _add_one_many_args_kernel[(1,)](x, *args, 1024),
                "distinct": lambda: _add_one_kernel[(1,)](x, 1024, next(salts))}
    if kind != "mixed":
        return launches[kind]
    launches = {name: launches[name] for name in ("add", "triton", "matmul")}
    turns = itertools.cycle(launches.values())
    return lambda: next(turns)()


def capture_chain(launch, kernels: int, instantiate: bool = True, stream: torch.cuda.Stream | None = None,
                  mode: str = "global") -> torch.cuda.CUDAGraph:
    """A graph of `kernels` launches captured on `stream` (None: PyTorch's one capture stream) in
    capture `mode`; PyTorch instantiates it at capture's end unless not `instantiate` (keep_graph:
    instantiated at its first replay, which it never gets here)."""
    graph = torch.cuda.CUDAGraph(keep_graph=not instantiate)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
        for _ in range(kernels):
            launch()
    return graph


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library this process has loaded (PyTorch's)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("no libcudart loaded in this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaGraphDestroy.argtypes = [ctypes.c_void_p]
    return lib


def make_before(how: str, launch, kernels: int) -> None:
    """One of the graphs made before the timed ones (--before-how), freed at once."""
    graph = ctypes.c_void_p()
    if how == "empty-cache":
        # what torch.cuda.graph does before each capture, here with a block cached to give back
        torch.empty(1 << 21, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    elif how == "capture-begin-end":
        # PyTorch's C++ capture alone (CUDAGraph.capture_begin / capture_end), of nothing: none of
        # torch.cuda.graph's Python steps before it
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.stream(torch.cuda.Stream()):
            graph.capture_begin()
            graph.capture_end()
    elif how == "runtime-captured":
        # the CUDA runtime's cudaStreamBeginCapture / EndCapture (PyTorch's calls) through ctypes, of nothing
        cudart, stream = _cudart(), torch.cuda.Stream()
        torch.cuda.synchronize()
        for result in (cudart.cudaStreamBeginCapture(ctypes.c_void_p(stream.cuda_stream), 0),
                       cudart.cudaStreamEndCapture(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(graph)),
                       cudart.cudaGraphDestroy(graph)):
            if result != 0:
                raise RuntimeError(f"CUDA runtime error {result}")
    elif how == "mem-pool":
        # the caching allocator's private pool (as a capture makes one), with a block allocated in it
        with torch.cuda.use_mem_pool(torch.cuda.MemPool()):
            torch.empty(1 << 21, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
    elif how == "host-empty-cache":
        torch._C._host_emptyCache()            # the other half of it: the pinned host blocks cached
    elif how == "created":
        cuda_driver.call("cuGraphCreate", ctypes.byref(graph), 0)
        cuda_driver.call("cuGraphDestroy", graph)
    elif how.startswith("driver-captured"):
        # the driver's own capture (global mode, 0), of nothing or of --kernels launches: PyTorch's
        # capture machinery (memory pool, generator state) not involved
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        cuda_driver.call("cuStreamBeginCapture_v2", ctypes.c_void_p(stream.cuda_stream), 0)
        if how == "driver-captured-kernels":
            with torch.cuda.stream(stream):
                for _ in range(kernels):
                    launch()
        cuda_driver.call("cuStreamEndCapture", ctypes.c_void_p(stream.cuda_stream), ctypes.byref(graph))
        cuda_driver.call("cuGraphDestroy", graph)
    else:
        capture_chain(launch, kernels if how == "uninstantiated" else 0, instantiate=how == "instantiated")


def median_replay_ms(graph: torch.cuda.CUDAGraph, replays: int, stream: torch.cuda.Stream) -> float:
    times = []
    with torch.cuda.stream(stream):
        graph.replay()
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=int, default=6, help="graphs made and timed (default 6)")
    ap.add_argument("--kernels", type=int, default=4000, help="kernels in each graph (default 4000)")
    ap.add_argument("--kind", choices=["add", "triton", "matmul", "mixed", "alloc", "args", "distinct"], default="add",
                    help="the graphs' kernels (default add)")
    ap.add_argument("--replays", type=int, default=20, help="replays timed per figure (default 20)")
    ap.add_argument("--upload", action="store_true", help="cuGraphUpload each graph after its instantiation")
    ap.add_argument("--free", action="store_true", help="free each graph after timing it (all but the first)")
    ap.add_argument("--before", type=int, default=0, help="graphs made and freed before the timed ones (default 0)")
    ap.add_argument("--before-how", choices=["instantiated", "uninstantiated", "empty", "created", "driver-captured",
                                             "driver-captured-kernels", "empty-cache", "host-empty-cache",
                                             "mem-pool", "capture-begin-end", "runtime-captured"],
                    default="uninstantiated",
                    help="those graphs: captured by PyTorch (--kernels) and instantiated; the same, never "
                         "instantiated (default); captured with no kernel, never instantiated; made by "
                         "cuGraphCreate; captured by the driver's cuStreamBeginCapture, of nothing or of --kernels; "
                         "or no graph: a 2 MiB block freed and torch.cuda.empty_cache(), or "
                         "torch._C._host_emptyCache(), each as torch.cuda.graph does before a capture; or a block "
                         "allocated in a torch.cuda.MemPool of its own, as a capture has; CUDAGraph.capture_begin and "
                         "capture_end alone, of nothing; the runtime's cudaStreamBeginCapture, of nothing")
    ap.add_argument("--capture-how", choices=["torch", "driver"], default="torch",
                    help="capture the timed graphs with torch.cuda.graph (default) or with the driver's stream "
                         "capture, PyTorch's allocations in a torch.cuda.MemPool (hisparse.graph_flags.DriverGraph)")
    ap.add_argument("--dump", metavar="DIR", help="write each timed graph's nodes (cudaGraphDebugDotPrint, "
                    "verbose) to DIR/graph<i>.dot (graphs captured by torch only)")
    ap.add_argument("--capture-stream", choices=["shared", "fresh"], default="shared",
                    help="capture every graph on PyTorch's one capture stream (default) or each on a new stream")
    ap.add_argument("--capture-mode", choices=["global", "thread_local", "relaxed"], default="global",
                    help="the stream capture mode (default global, PyTorch's)")
    ap.add_argument("--replay-stream", choices=["current", "side"], default="current",
                    help="replay on the current (default) stream or on one side stream")
    args = ap.parse_args(argv)
    if min(args.graphs, args.kernels, args.replays) < 1 or args.before < 0:
        raise SystemExit(f"--graphs, --kernels, --replays >= 1 and --before >= 0 expected, got "
                         f"{args.graphs}, {args.kernels}, {args.replays}, {args.before}")
    if args.capture_how == "driver" and (args.dump or args.capture_stream != "shared" or args.capture_mode != "global"):
        raise SystemExit("--dump, --capture-stream and --capture-mode apply to graphs captured by torch only "
                         "(--capture-how torch); the driver's capture takes a stream of its own, in global mode")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    launch = kernel_chain(args.kind)
    for _ in range(32):
        launch()                                           # compiled, loaded and planned before any capture
    for _ in range(args.before):
        make_before(args.before_how, launch, args.kernels)
    torch.cuda.synchronize()
    replay_stream = torch.cuda.Stream() if args.replay_stream == "side" else torch.cuda.current_stream()
    print(f"graphs of {args.kernels} {args.kind} kernels after {args.before} {args.before_how} ones; upload "
          f"{'on' if args.upload else 'off'}; {'freed once timed' if args.free else 'all kept'}; capture stream "
          f"{args.capture_stream}, mode {args.capture_mode}, by {args.capture_how}; replay stream "
          f"{args.replay_stream}", flush=True)
    graphs = []
    for i in range(args.graphs):
        dump = os.path.join(args.dump, f"graph{i + 1}.dot") if args.dump else None
        if args.capture_how == "driver":
            graph = graph_flags.DriverGraph(lambda: [launch() for _ in range(args.kernels)])
        else:
            graph = capture_chain(launch, args.kernels, instantiate=not dump,
                                  stream=torch.cuda.Stream() if args.capture_stream == "fresh" else None,
                                  mode=args.capture_mode)
            if dump:                                           # kept, so that it can be printed
                graph.debug_dump(dump)
                graph.instantiate()
        if args.upload:
            stream = torch.cuda.current_stream()
            exec_ = graph.exec_.value if args.capture_how == "driver" else graph.raw_cuda_graph_exec()
            cuda_driver.call("cuGraphUpload", ctypes.c_void_p(exec_),
                             ctypes.c_void_p(stream.cuda_stream))
            stream.synchronize()
        graphs.append(graph)
        own = median_replay_ms(graph, args.replays, replay_stream)
        first = median_replay_ms(graphs[0], args.replays, replay_stream)
        print(f"graph {i + 1}: its replay {own:7.3f} ms ({1e3 * own / args.kernels:.3f} us a kernel); "
              f"graph 1's now {first:7.3f} ms ({1e3 * first / args.kernels:.3f} us a kernel)", flush=True)
        if args.free and i > 0:
            graphs.pop()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
