"""The decode variants of kernels_triton/dsa_variants.py against hisparse.dsa's torch reference (CPU:
Triton's interpreter, small tiles), and the property exactness relies on: the output depends on the
rows' order only (the same rows at other places in kv, or as local ids from row_base: bitwise equal).
float16 stands in for bfloat16: the interpreter's bfloat16 dot is wrong (the default kernel's too).
"""
import pytest
import torch

from hisparse import dsa
from kernels_triton import dsa_variants as dv

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SMALL = [
    pytest.param(dict(block_h=16, block_k=16, v_split=1), id="h16-k16-v1"),
    pytest.param(dict(block_h=16, block_k=16, v_split=2), id="h16-k16-v2"),
    pytest.param(dict(block_h=32, block_k=32, v_split=2), id="h32-k32-v2"),
]


def inputs(n, h, d_v, d_rope, r, k, dtype, seed):
    """q, kv, rows [n, k] int32 distinct with about 20% -1, the last request all -1."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d_v + d_rope, generator=gen).to(dtype)
    kv = torch.randn(r, d_v + d_rope, generator=gen).to(dtype)
    rows = torch.stack([torch.randperm(r, generator=gen)[:k] for _ in range(n)]).to(torch.int32)
    rows[torch.rand(n, k, generator=gen) < 0.2] = -1
    rows[-1] = -1
    return q, kv, rows


@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("tiles", SMALL)
def test_fused_matches_ref(tiles, dtype, splits):
    q, kv, rows = inputs(3, 20, 64, 16, 90, 53, dtype, seed=1)  # 20 heads: a partial head block
    out = dv.mla_decode_fused(q, kv, rows, None, 0.1, d_v=64, num_splits=splits, **tiles)
    ref, _ = dsa.sparse_mla_decode_ref(q, kv, rows, 0.1, d_v=64)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "no valid row must give zeros"


def test_fused_model_width_matches_ref():
    """D 512 + 64 as the model, 16 heads, a few rows; v_split 2 as on the GPU."""
    q, kv, rows = inputs(2, 16, 512, 64, 40, 20, torch.float16, seed=2)
    out = dv.mla_decode_fused(q, kv, rows, None, 0.05, d_v=512, block_h=16, block_k=16, v_split=2, num_splits=2)
    ref, _ = dsa.sparse_mla_decode_ref(q, kv, rows, 0.05, d_v=512)
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("tiles", SMALL[1:2])
def test_fused_depends_on_row_order_only(tiles):
    """The same rows moved elsewhere in a bigger kv, or named by local ids from row_base: bitwise equal."""
    n, r = 3, 50
    q, kv, rows = inputs(n, 20, 64, 16, r, 37, torch.float16, seed=3)
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(n * r, 80, generator=gen).to(torch.float16)  # request i's region: rows i*r ...
    base = torch.arange(n, dtype=torch.int64) * r
    perm = torch.stack([torch.randperm(r, generator=gen) for _ in range(n)])  # local id -> place in region
    for i in range(n):
        pool[base[i] + perm[i]] = kv
    local = torch.where(rows >= 0, torch.gather(perm, 1, rows.clamp_min(0).long()), -1).to(torch.int32)
    glob = torch.where(rows >= 0, local + base[:, None], -1).to(torch.int32)
    for splits in (1, 2):
        want = dv.mla_decode_fused(q, kv, rows, None, 0.1, d_v=64, num_splits=splits, **tiles)
        got_glob = dv.mla_decode_fused(q, pool, glob, None, 0.1, d_v=64, num_splits=splits, **tiles)
        got_local = dv.mla_decode_fused(q, pool, local, base, 0.1, d_v=64, num_splits=splits, **tiles)
        assert torch.equal(want, got_glob) and torch.equal(want, got_local)
