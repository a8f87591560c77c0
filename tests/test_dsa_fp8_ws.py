"""The warp-specialised Gluon FP8 decode kernel (kernels_triton/dsa_fp8_gluon_ws.py, run through
experiments/tools/gluon_fp8_ws.py) against today's Gluon FP8 kernel (`sparse_mla_decode_fp8(..., backend="gluon")`),
which it should equal bit for bit: the same dequantised K tiles, the same matrix math in the same order.

CPU tests (Triton's interpreter cannot run Gluon kernels): it takes today's kernel's arguments, so today's launcher
runs it, and the swap is undone whatever happens; bad inputs are refused before any launch. GPU tests (Hopper,
Triton 3.6): first, in a subprocess with a time limit, one small launch (a wrong barrier phase hangs the GPU: the
subprocess is killed instead of the test run); then bitwise equality at batch 1, 3 and 64, 128, 96 and 64 heads,
k 2048, 1999 and 333 (short last tiles), -1 rows (scattered, half a request, a whole request), row_base, split
counts 1 and several, and graphed replays equal to eager launches.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_dsa import rel_err
from test_dsa_fp8 import DSV32_SCALE, TOL, gluon_fp8_inputs, hot_and_resident

from experiments.tools import gluon_fp8_ws
from hisparse.dsa import fp8
from kernels_triton import dsa_fp8_gluon, dsa_fp8_gluon_ws


class NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched")


# ---------------------------------------------------------------------------------------------
# CPU: the swap into today's launcher, and refusals
# ---------------------------------------------------------------------------------------------

def test_ws_kernel_takes_todays_arguments_and_tiles():
    """Today's launcher (`_launch_gluon`) passes the warp-specialised kernel its own kernel's arguments and tile
    constants: the parameter lists are the same but for OVERLAP (the tool adds it), and the shapes both modules
    assume agree."""
    today, ws = dsa_fp8_gluon._sparse_mla_decode_fp8_gluon_kernel, dsa_fp8_gluon_ws._sparse_mla_decode_fp8_ws_kernel
    if dsa_fp8_gluon.GLUON_IMPORT_ERROR is not None:
        assert today is None and ws is None
        return
    assert ws.arg_names == today.arg_names + ["OVERLAP"]
    tiles = fp8.GLUON_FP8_TILES
    assert (tiles.block_h, tiles.block_k, tiles.num_stages, tiles.num_warps) == (
        dsa_fp8_gluon_ws.BLOCK_H, dsa_fp8_gluon_ws.BLOCK_K, dsa_fp8_gluon_ws.NUM_BUFFERS, dsa_fp8_gluon_ws.NUM_WARPS)
    # the setmaxnreg budget: 8 consumer warps and the producer's within 64K registers, the consumers above 160
    warps = dsa_fp8_gluon_ws.NUM_WARPS + dsa_fp8_gluon_ws.PRODUCER_WARPS
    pool = 65536 // (warps * 32) // 8 * 8 * warps * 32
    for producer in (dsa_fp8_gluon_ws.PRODUCER_REGS, dsa_fp8_gluon_ws.PRODUCER_REGS_OVERLAP):
        consumers = (pool - producer * dsa_fp8_gluon_ws.PRODUCER_WARPS * 32) // (dsa_fp8_gluon_ws.NUM_WARPS * 32)
        assert producer % 8 == 0 and 24 <= producer and consumers // 8 * 8 >= 160, producer


def test_ws_swap_is_undone_and_bad_inputs_are_refused_before_launching(monkeypatch):
    """Inside `ws_kernel()` the launcher's kernel is the warp-specialised one, outside today's again (also after
    an exception); `decode_ws` refuses what `sparse_mla_decode_fp8` refuses (here CPU tensors and int64 rows),
    with its message, before any launch."""
    monkeypatch.setattr(dsa_fp8_gluon_ws, "_sparse_mla_decode_fp8_ws_kernel", NoLaunch())
    today = fp8._sparse_mla_decode_fp8_gluon_kernel
    with pytest.raises(RuntimeError, match="inside"):
        with gluon_fp8_ws.ws_kernel():
            assert isinstance(fp8._sparse_mla_decode_fp8_gluon_kernel.kernel, NoLaunch)
            raise RuntimeError("inside")
    assert fp8._sparse_mla_decode_fp8_gluon_kernel is today
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 128, 576, generator=gen).bfloat16()
    kv = fp8.quantize_rows(torch.randn(40, 512, generator=gen), torch.randn(40, 64, generator=gen))
    rows = torch.randint(-1, 40, (2, 16), generator=gen, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend='gluon': the Gluon FP8 decode kernel cannot run this"):
        gluon_fp8_ws.decode_ws(q, kv, rows, 0.1)
    with pytest.raises(ValueError, match="rows must be int32"):
        gluon_fp8_ws.decode_ws(q, kv, rows.long(), 0.1)
    assert fp8._sparse_mla_decode_fp8_gluon_kernel is today


def test_ws_swap_reaches_the_launch(monkeypatch):
    """Inside the swap, today's launcher launches the warp-specialised kernel (else the GPU tests would compare
    today's kernel with itself), outside it today's."""
    monkeypatch.setattr(dsa_fp8_gluon_ws, "_sparse_mla_decode_fp8_ws_kernel", NoLaunch())
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 128, 576, generator=gen).bfloat16()
    kv = fp8.quantize_rows(torch.randn(40, 512, generator=gen), torch.randn(40, 64, generator=gen))
    rows = torch.randint(-1, 40, (2, 16), generator=gen, dtype=torch.int32)
    out, lse = torch.empty(2, 128, 512, dtype=torch.bfloat16), torch.empty(2, 128)
    with gluon_fp8_ws.ws_kernel(), pytest.raises(AssertionError, match="a kernel was launched"):
        fp8._launch_gluon(q, kv, rows, None, out, lse, 0.1, 1)
    launched = []

    class Record:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(grid)

    monkeypatch.setattr(fp8, "_sparse_mla_decode_fp8_gluon_kernel", Record())
    fp8._launch_gluon(q, kv, rows, None, out, lse, 0.1, 1)
    assert launched == [(2, 2, 1)]


def test_same_bits_tells_signed_zeros_apart():
    """The tests' bitwise check: -0.0 and 0.0 are equal values but not the same bits."""
    zero = torch.zeros(3, dtype=torch.bfloat16)
    assert torch.equal(zero, -zero) and not gluon_fp8_ws.same_bits(zero, -zero)
    assert gluon_fp8_ws.same_bits(zero.float(), zero.float().clone())


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def needs_ws():
    """Skip where the Gluon FP8 kernel cannot run; else, once, `--smoke` in a subprocess with a time limit (one
    small launch bitwise equal to today's kernel). Its failure fails every GPU test here rather than hanging
    the run."""
    probe = torch.empty(1, 128, 576, dtype=torch.bfloat16, device="cuda")
    reason = fp8.fp8_gluon_unsupported(probe, torch.empty(1, 656, dtype=torch.uint8, device="cuda"))
    if reason:
        pytest.skip(f"the Gluon FP8 kernels cannot run here: {reason}")
    try:
        run = subprocess.run([sys.executable, "-m", "experiments.tools.gluon_fp8_ws", "--smoke"],
                             capture_output=True, text=True, timeout=240, cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"--smoke did not finish in 240 s (a hang: a barrier phase?): {exc.stdout} {exc.stderr}")
    if run.returncode != 0:
        pytest.fail(f"--smoke failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")


def assert_bitwise(got, ref, what: str):
    out, lse = got
    ref_out, ref_lse = ref
    lse_diff = (lse - ref_lse).abs().nan_to_num().max()
    assert gluon_fp8_ws.same_bits(lse, ref_lse), f"{what}: lse differs, max {lse_diff:.3g}"
    out_diff = (out.float() - ref_out.float()).abs().max()
    assert gluon_fp8_ws.same_bits(out, ref_out), f"{what}: out differs, max {out_diff:.3g}"


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_ws")
@pytest.mark.parametrize("n,h,k", [(1, 128, 2048), (3, 128, 2048), (64, 128, 2048), (3, 128, 1999), (4, 96, 1999),
                                   (3, 64, 333)],
                         ids=["N1-H128-k2048", "N3-H128-k2048", "N64-H128-k2048", "N3-H128-k1999", "N4-H96-k1999",
                              "N3-H64-k333"])
@pytest.mark.parametrize("splits", [None, 1, 3, 7], ids=["splits-auto", "splits1", "splits3", "splits7"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_gpu_ws_equals_todays_gluon_fp8_kernel_bitwise(n, h, k, splits, overlap):
    """out and lse bit for bit today's Gluon FP8 kernel's, every element written (out and lse poisoned with NaN);
    -1 rows scattered (about 10%), request 1 from position 1000 on, request 2 all; k 1999 and 333 end on short
    tiles, 96 heads leave half a head block empty. Within the bf16 tolerance of the torch reference too, the
    empty request zeros and -inf."""
    q, kv, rows = gluon_fp8_inputs(n, h, k)
    out = torch.full((n, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((n, h), float("nan"), device="cuda")
    got = gluon_fp8_ws.decode_ws(q, kv, rows, DSV32_SCALE, overlap, num_splits=splits, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    ref = fp8.sparse_mla_decode_fp8(q, kv, rows, DSV32_SCALE, num_splits=splits, backend="gluon")
    assert_bitwise((out, lse), ref, f"n {n} h {h} k {k} splits {splits} overlap {overlap}")
    ref_out, ref_lse = fp8.sparse_mla_decode_fp8_ref(q, kv, rows, DSV32_SCALE)
    assert rel_err(out, ref_out) < TOL[torch.bfloat16] and rel_err(lse, ref_lse) < 1e-4
    if n > 2:
        assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isinf(lse[2]).all() and (lse[2] < 0).all()


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_ws")
@pytest.mark.parametrize("splits", [1, 7], ids=["splits1", "splits7"])
def test_gpu_ws_with_row_base_and_repeated_launches(splits):
    """Through row_base (hot-cache slots), the resident rows' bits (same bytes, same order) and today's kernel's
    with the same row_base, on every one of 3 repeated launches."""
    gen = torch.Generator().manual_seed(24)
    streams, slots = 8, 4096
    kv_res, rows_res, kv_hot, rows_hot = hot_and_resident(streams, 8192, slots, 2048, gen)
    kv_res, rows_res, kv_hot, rows_hot = kv_res.cuda(), rows_res.cuda(), kv_hot.cuda(), rows_hot.cuda()
    q = (torch.randn(streams, 128, 576, generator=gen) * 0.3).bfloat16().cuda()
    base = torch.arange(streams, dtype=torch.int64, device="cuda") * (slots + 1)
    ref_hot = fp8.sparse_mla_decode_fp8(q, kv_hot, rows_hot, DSV32_SCALE, row_base=base, num_splits=splits,
                                        backend="gluon")
    res = gluon_fp8_ws.decode_ws(q, kv_res, rows_res, DSV32_SCALE, num_splits=splits)
    for _ in range(3):
        hot = gluon_fp8_ws.decode_ws(q, kv_hot, rows_hot, DSV32_SCALE, row_base=base, num_splits=splits)
        assert_bitwise(hot, ref_hot, "row_base against today's kernel")
        assert_bitwise(hot, res, "row_base against the resident rows")


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_ws")
@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
def test_gpu_ws_graphed_equals_eager(splits):
    """Captured once in a CUDA graph (splits 3: partial buffers and the combine inside it), replayed over new rows
    copied into the captured tensors: each replay bitwise the eager launch over the same inputs, and that
    today's kernel's."""
    q, kv, rows = gluon_fp8_inputs(16, 128, 2048, context=8192)
    static_q, static_rows = q.clone(), rows.clone()
    out = torch.empty(16, 128, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(16, 128, device="cuda")
    gluon_fp8_ws.decode_ws(static_q, kv, static_rows, DSV32_SCALE, num_splits=splits, out=out, lse=lse)  # compiled
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gluon_fp8_ws.decode_ws(static_q, kv, static_rows, DSV32_SCALE, num_splits=splits, out=out, lse=lse)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for step in range(3):
        new_rows = rows[torch.randperm(16, device="cuda", generator=gen)]      # other requests' rows and -1s
        static_rows.copy_(new_rows)
        static_q.copy_(q * (1 + step))
        graph.replay()
        torch.cuda.synchronize()
        eager = gluon_fp8_ws.decode_ws(q * (1 + step), kv, new_rows, DSV32_SCALE, num_splits=splits)
        assert_bitwise((out, lse), eager, f"replay {step}")
        assert_bitwise(eager, fp8.sparse_mla_decode_fp8(q * (1 + step), kv, new_rows, DSV32_SCALE,
                                                        num_splits=splits, backend="gluon"), f"eager {step}")
