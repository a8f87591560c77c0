"""Whether the machine can hold what a server's options ask for, judged before anything large is
allocated: the command refuses a size that cannot fit, naming the option and both numbers, rather
than dying in an allocator (a lane at --max-context 100000000 is tens of GB of KV).

What a server allocates (`hisparse.serving.memory.LaneMemory`): on the model's device, its lanes
(each `lane_bytes` at max_context), the cache's slot map (4 bytes per host row) and the prefill
workspace; on the host, the pool (host rows x row bytes) in the hierarchical modes. A lane's bytes
are affine in the context (units of `runtime.unit_size` tokens), so they are measured on one-lane
probes at two small contexts and extrapolated; the machine's side is the device's free memory
(`torch.cuda.mem_get_info`) and the host's available memory (psutil when present, else
/proc/meminfo's MemAvailable, else every physical page). On a CPU device both live in host memory.
"""
from __future__ import annotations

import math
import os

import torch

from hisparse.runtime import FamilyRuntime
from hisparse.serving import GIB
from hisparse.serving.memory import LaneMemory

PROBE_UNITS = (64, 128)     # the probes' contexts, in units: a few MB of KV on the largest models here


def size(n: float) -> str:
    """Bytes for a person: "384 B", "1.5 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def host_available() -> int:
    """Bytes of host memory a new allocation can have now."""
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_available(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available()


def lane_bytes(runtime: FamilyRuntime, mode: str, cache_slots: int | None, max_context: int,
               device: torch.device) -> int:
    """Device bytes of one lane at max_context, from one-lane probes no larger than PROBE_UNITS units."""
    unit = runtime.unit_size
    short, long = (u * unit for u in PROBE_UNITS)

    def probe(context: int) -> int:
        return LaneMemory(runtime, mode, cache_slots, context, None, None, 1, 1, False, device).lane_bytes
    if max_context <= long:
        return probe(max_context)
    a, b = probe(short), probe(long)
    return a + math.ceil((b - a) * (math.ceil(max_context / unit) * unit - short) / (long - short))


def refusal(runtime: FamilyRuntime, device: torch.device, mode: str, cache_slots: int | None, max_context: int,
            kv_budget_gib: float, host_budget_gib: float | None, max_batch: int) -> tuple[str, str] | None:
    """(option, why) when the machine cannot hold what these options allocate, else None. A
    ValueError of the engine's own checks (e.g. cache_slots below k) is left to the Server."""
    hierarchical = mode != "resident"
    row = runtime.row_bytes
    if hierarchical and host_budget_gib is not None:
        smallest = sum(runtime.stream_regions(2))          # one prompt token and one new
        if host_budget_gib * GIB // row < smallest:
            return "--host-budget-gib", (f"{host_budget_gib} GiB ({size(host_budget_gib * GIB)}) holds no request: "
                                         f"the smallest (one prompt token, one new) needs {smallest} host pool "
                                         f"rows of {row} B, {size(smallest * row)}")
        if host_budget_gib * GIB > host_available():
            return "--host-budget-gib", (f"{host_budget_gib} GiB is a host pool of {size(host_budget_gib * GIB)}; "
                                         f"this machine has {size(host_available())} of memory available")
    lane = lane_bytes(runtime, mode, cache_slots, max_context, device)
    workspace = runtime.lane_workspace_bytes(mode, max_context)
    on_device = device_available(device)
    where = f"the device ({device}) has {size(on_device)} free" if device.type == "cuda" else \
        f"this machine has {size(on_device)} of memory available (the {device} device's allocations are host memory)"
    if lane + workspace > on_device:
        return "--max-context", (f"{max_context} tokens make one lane about {size(lane)} of KV (with its prefill "
                                 f"workspace, {size(lane + workspace)}); {where}")
    host_rows = 0
    if hierarchical and host_budget_gib is not None:
        host_rows = int(host_budget_gib * GIB // row)
    fits = (int(kv_budget_gib * GIB) - workspace - 4 * host_rows) // lane
    if fits < 1:
        return None                        # the Server says the budget holds no lane, and why
    lanes = min(max_batch, fits)
    if hierarchical and host_budget_gib is None:
        host_rows = lanes * sum(runtime.stream_regions(max_context))
    need = lanes * lane + workspace + 4 * host_rows
    if mode == "hybrid":                   # the budget the lanes leave goes to more streams of the cache
        need = max(need, int(kv_budget_gib * GIB))
    if need > on_device:
        return "--kv-budget-gib", (f"{kv_budget_gib} GiB makes {lanes} lanes of about {size(lane)} at --max-context "
                                   f"{max_context}: {size(need)} with the prefill workspace and the cache's slot map; "
                                   f"{where} (lower --kv-budget-gib or --max-batch)")
    on_host = host_available() - (need if device.type != "cuda" else 0)
    pool = host_rows * row
    if pool > on_host:
        if host_budget_gib is not None:
            return "--host-budget-gib", (f"{host_budget_gib} GiB is a host pool of {size(pool)}; this machine has "
                                         f"{size(on_host)} of memory available for it")
        return "--max-context", (f"the host pool holds every lane ({lanes}) at --max-context {max_context}: "
                                 f"{size(pool)}; this machine has {size(on_host)} of memory available for it "
                                 f"(give --host-budget-gib, or lower --max-context or --max-batch)")
    return None
