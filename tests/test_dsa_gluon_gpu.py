"""The Gluon sparse MLA decode kernel (kernels_triton/dsa_gluon.py, launched by hisparse/dsa/ops.py)
against hisparse/dsa/reference.py's torch reference, on a Hopper GPU only (Gluon kernels do not run
in the interpreter; skipped elsewhere).

    python -m pytest -q -m gpu tests/test_dsa_gluon_gpu.py      # on an H100 / H200, Triton 3.6
    python -m benchmarks.bench_attention_dsa --tune             # times it beside the Triton kernel's configs

bf16 at the model's shapes: 128 heads, D 576 (512 + 64), k = 2048, batch 2-4; scattered -1 rows, a
short request, a request with no valid row, row_base, and one and two splits.
"""
import pytest
import torch
from test_dsa import DSV32_SCALE, TOL, rel_err

from hisparse.dsa import ops as dsa
from hisparse.dsa import reference as dsa_ref
from hisparse.dsa.ops import sparse_mla_decode_gluon

TOL_BF16 = TOL[torch.bfloat16]


def _skip_reason():
    """Why the Gluon kernel cannot run here (no GPU, not Hopper, no Triton 3.6 Gluon), or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return dsa.gluon_decode_unsupported(torch.empty(1, 64, 576, dtype=torch.bfloat16, device="cuda"), 512)


def decode_inputs(n: int, context: int, k: int = 2048, h: int = 128, seed: int = 20):
    """kv [n * context, 576] bf16 (request i owns rows i*context ...), q [n, h, 576], rows [n, k] int32
    global row numbers: about 10% scattered -1, request 1 valid for its first 1000 only (when n > 2),
    the last request none at all."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(n * context, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(n, h, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    tokens = torch.rand(n, context, device="cuda", generator=gen).topk(k, dim=1).indices
    rows = (tokens + torch.arange(n, device="cuda")[:, None] * context).to(torch.int32)
    rows[torch.rand(n, k, device="cuda", generator=gen) < 0.1] = -1
    if n > 2:
        rows[1, 1000:] = -1
    rows[-1] = -1
    return q, kv, rows


@pytest.fixture(autouse=True)
def _needs_hopper_and_gluon():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2], ids=["splits1", "splits2"])
@pytest.mark.parametrize("batch", [2, 4], ids=["N2", "N4"])
def test_gpu_gluon_decode_matches_ref(batch, splits, nan_empty):
    q, kv, rows = decode_inputs(batch, 32768)
    out, lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, num_splits=splits)
    torch.cuda.synchronize()
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
    assert out.shape == (batch, 128, 512) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_err(out, ref_out) < TOL_BF16
    assert rel_err(lse, ref_lse) < 1e-4
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "no valid row must give zeros"
    assert torch.isneginf(lse[-1]).all()
    # and close to the Triton kernel (not bitwise: the accumulation order differs)
    tri_out, tri_lse = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, num_splits=splits, backend="triton")
    assert rel_err(out, tri_out) < TOL_BF16 and rel_err(lse, tri_lse) < 1e-4


@pytest.mark.gpu
def test_gpu_gluon_is_the_default_decode_here():
    """On this Hopper GPU with Triton 3.6, sparse_mla_decode's default backend ("auto") runs the
    Gluon kernel at the model's shape (bitwise its output)."""
    q, kv, rows = decode_inputs(2, 8192, seed=24)
    assert dsa.gluon_decode_unsupported(q, 512) is None
    assert dsa.decode_backend(q, 512) == "gluon"
    assert dsa.decode_backend(q[:, :32], 512) == "triton", "fewer than 64 heads: Triton"
    out, lse = dsa.sparse_mla_decode(q, kv, rows, DSV32_SCALE, num_splits=1)
    g_out, g_lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, num_splits=1)
    assert torch.equal(out, g_out) and torch.equal(lse, g_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 4], ids=["N2", "N4"])
def test_gpu_gluon_decode_row_base(batch):
    """rows as request-local ids from row_base[n]: the reference's answer, and bitwise the answer of
    the same rows given as global rows."""
    context = 8192
    q, kv, rows = decode_inputs(batch, context, seed=21)
    base = torch.arange(batch, device="cuda", dtype=torch.int64) * context
    local = torch.where(rows >= 0, rows - base[:, None], -1).to(torch.int32)
    out, lse = sparse_mla_decode_gluon(q, kv, local, DSV32_SCALE, row_base=base)
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, local, DSV32_SCALE, row_base=base)
    assert rel_err(out, ref_out) < TOL_BF16
    assert rel_err(lse, ref_lse) < 1e-4
    glob_out, glob_lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE)
    assert torch.equal(out, glob_out) and torch.equal(lse, glob_lse)


@pytest.mark.gpu
def test_gpu_gluon_decode_every_row_valid_and_tail_tile():
    """No -1 at all (every tile full), and k not a multiple of the 64-row tile (a partial last tile)."""
    for k in (2048, 2000):
        gen = torch.Generator(device="cuda").manual_seed(22)
        kv = torch.randn(3 * 4096, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn(3, 128, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
        rows = torch.stack([torch.randperm(kv.shape[0], device="cuda", generator=gen)[:k] for _ in range(3)])
        rows = rows.to(torch.int32)
        out, lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE)
        ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
        assert rel_err(out, ref_out) < TOL_BF16, k
        assert rel_err(lse, ref_lse) < 1e-4, k


@pytest.mark.gpu
@pytest.mark.parametrize("block_k, num_stages", [(64, 3), (32, 3), (32, 4)], ids=["bk64-st3", "bk32-st3", "bk32-st4"])
def test_gpu_gluon_decode_other_tiles_and_rings(block_k, num_stages):
    """Smaller tiles and deeper rings of gathered tiles (wait_group(NUM_STAGES - 2)); (64, 3) does not fit
    Hopper's shared memory and must be refused by the launch, not run wrong."""
    import triton.runtime.errors

    q, kv, rows = decode_inputs(3, 8192, seed=23)
    if block_k * 1152 * num_stages + 72 * 1024 > 227 * 1024:
        with pytest.raises(triton.runtime.errors.OutOfResources):
            sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, block_k=block_k, num_stages=num_stages)
        return
    out, lse = sparse_mla_decode_gluon(q, kv, rows, DSV32_SCALE, block_k=block_k, num_stages=num_stages)
    ref_out, ref_lse = dsa_ref.sparse_mla_decode_ref(q, kv, rows, DSV32_SCALE)
    assert rel_err(out, ref_out) < TOL_BF16
    assert rel_err(lse, ref_lse) < 1e-4
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
