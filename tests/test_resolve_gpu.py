"""Resolve on the GPU at real sizes: k = 2048, B = 4096, batch 64, 1152-byte rows (576 bf16),
eagerly and inside a CUDA graph captured once and replayed with changing selections. The
reference runs on the CPU on a copy of the same state."""
import pytest
import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.host_pool import HostPool
from hisparse.resolve import ResolveResult, fetch_rows

pytestmark = pytest.mark.gpu

N, K, B, E, CONTEXT = 64, 2048, 4096, 576, 16384


def selections(gen, steps):
    """Each step keeps ~70% of the previous selection and draws the rest fresh; some rows pad."""
    sel = torch.stack([torch.randperm(CONTEXT, generator=gen)[:K] for _ in range(N)])
    out = []
    for _ in range(steps):
        fresh = torch.randint(0, CONTEXT, (N, K), generator=gen)
        replace = torch.rand(N, K, generator=gen) < 0.3
        cand = torch.where(replace, fresh, sel)
        rows = []
        for r in range(N):   # keep unique ids, in a new order, then pad some rows
            u = torch.unique(cand[r])
            u = u[torch.randperm(len(u), generator=gen)]
            row = torch.full((K,), -1, dtype=torch.int64)
            n = len(u) if r % 5 else len(u) // 2
            row[:n] = u[:n]
            rows.append(row)
        sel = torch.stack(rows)
        out.append(sel.to(torch.int32))
    return out


def build(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(N, CONTEXT, E, generator=gen).to(torch.bfloat16)
    cache = HierarchicalKVCache(N, B, host_rows=N * CONTEXT, row_elems=E, dtype=torch.bfloat16, device=device)
    for r in range(N):
        cache.append(cache.open_stream(CONTEXT), data[r])
    return cache


def check_step(gpu, cpu, streams, sel, res):
    want = cpu.resolve_ref(streams.cpu(), sel.cpu(), mode="noio")
    assert torch.equal(res.slots.cpu(), want.slots)
    assert torch.equal(res.counts.cpu(), want.counts)
    for name in ("lru", "lru_unit", "unit_slot", "stats"):
        assert torch.equal(getattr(gpu.state, name).cpu(), getattr(cpu.state, name)), name
    # every slot holds the host row of its unit, bit for bit
    valid = sel >= 0
    s_idx = streams[:, None].long().expand_as(sel)[valid]
    got = gpu.slots[s_idx, res.slots[valid].long()]
    host_rows = gpu.state.host_base[s_idx] + sel[valid].long()
    want_rows = gpu.host.rows[host_rows.cpu()].to(got.device)
    assert torch.equal(got.view(torch.int16), want_rows.view(torch.int16))


VARIANTS = {"packed_scan": dict(), "single_scan": dict(packed_scan=False)}     # the default at B=4096: packed


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resolve_matches_reference_eager_and_graph(variant):
    opts = VARIANTS[variant]
    device = torch.device("cuda")
    gpu = build(device)
    cpu = HierarchicalKVCache(N, B, host_rows=N * CONTEXT, row_elems=E, dtype=torch.bfloat16, device="cpu",
                              pin=False)
    for r in range(N):
        cpu.open_stream(CONTEXT)
        cpu.stream_len[r] = CONTEXT
    gen = torch.Generator().manual_seed(1)
    streams = torch.randperm(N, generator=gen).to(torch.int32).to(device)
    steps = selections(gen, 12)

    for sel in steps[:4]:                                   # eager, with value checks
        res = gpu.resolve(streams, sel.to(device), **opts)
        check_step(gpu, cpu, streams, sel.to(device), res)

    static_sel = steps[4].to(device).clone()
    out = ResolveResult(*(torch.full(s, -7, dtype=torch.int32, device=device)
                          for s in ((N, K), (N, 2), (N, K), (N, K))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.resolve(streams, static_sel, check_values=False, out=out, **opts)
    for sel in steps[4:]:                                   # replayed with changing selections
        static_sel.copy_(sel.to(device))
        graph.replay()
        torch.cuda.synchronize()
        check_step(gpu, cpu, streams, static_sel, out)
    hits, misses = gpu.stats.sum(0).tolist()
    assert hits > 0 and misses > 0


def test_fetch_past_2_31_words_on_gpu():
    """A 9 GiB pinned pool of 40 KiB rows: host offsets past 2**31 words must not wrap."""
    device = torch.device("cuda")
    e = 20480                                                # 40960-byte rows, 10240 int32 words
    far_rows = (1 << 31) // (e // 2) + 64
    cache = HierarchicalKVCache(2, 8, host_rows=far_rows + 64, row_elems=e, dtype=torch.bfloat16, device=device)
    cache.open_stream(far_rows)
    far = cache.open_stream(64)
    rows = torch.randn(40, e).to(torch.bfloat16)
    cache.append(far, rows)
    sel = torch.tensor([[3, 39, 0, 17]], dtype=torch.int32, device=device)
    res = cache.resolve(torch.tensor([far], dtype=torch.int32, device=device), sel)
    assert torch.equal(cache.slots[far, res.slots[0].long()].cpu(), rows[sel[0].long().cpu()])
    # the newest row written by the resolve lands there too: unit 39 (cached) rewritten
    new = torch.randn(1, e).to(torch.bfloat16)
    cache.resolve(torch.tensor([far], dtype=torch.int32, device=device), sel, mode="noio",
                  newest=(torch.tensor([39], device=device), new.to(device)))
    torch.cuda.synchronize()
    assert torch.equal(cache.host.rows[int(cache.state.host_base[far]) + 39], new[0])
    assert torch.equal(cache.slots[far, int(res.slots[0, 1])].cpu(), new[0])


def test_host_pool_is_pinned_and_read_zero_copy_and_unpinned_when_dropped():
    """The pool is page-locked by cudaHostRegister (no power-of-two rounding, an odd size here), read
    zero-copy by the kernels, and unregistered when the pool goes."""
    pool = HostPool(3 * 1000 + 7, 576, torch.bfloat16)       # an odd size: 3.5 MB, not a power of two
    assert pool.rows.is_pinned()
    new = torch.randn(pool.capacity, 576, device="cuda").to(torch.bfloat16)
    pool.write(0, new)
    torch.cuda.synchronize()
    cache = torch.empty(1, 2, 576, dtype=torch.bfloat16, device="cuda")
    plan = torch.tensor([[pool.capacity - 1]], dtype=torch.int32, device="cuda")
    fetch_rows(plan, torch.zeros_like(plan), torch.tensor([[0, 1]], dtype=torch.int32, device="cuda"),
               torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda"),
               pool.rows, cache)
    assert torch.equal(cache[0, 0], new[-1])
    host_rows = pool.rows
    del pool
    assert not host_rows.is_pinned(), "the pool's memory must be unregistered with the pool"
