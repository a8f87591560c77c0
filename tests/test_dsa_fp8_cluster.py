"""The 2-CTA cluster Gluon FP8 decode kernel (kernels_triton/dsa_fp8_gluon_cluster.py) against today's Gluon
FP8 kernel (`sparse_mla_decode_fp8(..., backend="gluon")`), which it should equal bit for bit at 128 heads.

CPU tests (Triton's interpreter cannot run Gluon kernels): the launcher refuses what it cannot run with a
ValueError naming why, before any launch, and launches with today's split plan and arguments. GPU tests (Hopper,
Triton 3.6): first, in a subprocess with a time limit, the shared offsets the kernel's inline PTX assumes and one
small launch (a wrong offset or barrier hangs the GPU: the subprocess is killed instead of the test run); then
bitwise equality at batch 1, 3 and 64, k 2048 and 1999 (a short last tile), -1 rows (scattered, half a request,
a whole request), row_base, split counts 1 and several, and graphed replays equal to eager launches.
"""
import subprocess
import sys

import pytest
import torch
from test_dsa import rel_err
from test_dsa_fp8 import DSV32_SCALE, TOL, gluon_fp8_inputs, hot_and_resident

from hisparse.dsa import fp8
from hisparse.dsa import ops as dsa
from experiments.tools import gluon_fp8_cluster as cluster


class NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("a kernel was launched")


def cluster_inputs(n: int, h: int = 128, k: int = 16, r: int = 40, device: str = "cpu"):
    gen = torch.Generator().manual_seed(5)
    latent, rope = torch.randn(r, 512, generator=gen), torch.randn(r, 64, generator=gen)
    q = torch.randn(n, h, 576, generator=gen).bfloat16()
    rows = torch.randint(-1, r, (n, k), generator=gen, dtype=torch.int32)
    return q.to(device), fp8.quantize_rows(latent, rope).to(device), rows.to(device)


# ---------------------------------------------------------------------------------------------
# CPU: refusals and the launch's arguments
# ---------------------------------------------------------------------------------------------

def test_cluster_launcher_refuses_what_it_cannot_run_before_launching(monkeypatch):
    """Heads other than 128 (named wherever the tensors are), CPU tensors, a Triton without this Gluon, and the
    inputs `sparse_mla_decode_fp8` refuses: each a ValueError naming the problem, no kernel launched."""
    monkeypatch.setattr(cluster, "_sparse_mla_decode_fp8_cluster_kernel", NoLaunch())
    q, kv, rows = cluster_inputs(2)
    prefix = "the 2-CTA cluster FP8 decode kernel cannot run this: "
    cpu = "q is on cpu, not a CUDA GPU" if cluster.GLUON_IMPORT_ERROR is None else "has no usable Gluon"
    cases = [
        ({"q": q[:, :64].contiguous()}, prefix + "64 heads: it runs exactly 128"),
        ({"q": q[:, :96].contiguous()}, prefix + "96 heads: it runs exactly 128"),
        ({"q": torch.cat([q, q], dim=1)}, prefix + "256 heads: it runs exactly 128"),
        ({}, prefix + cpu),
        ({"rows": rows.long()}, "rows must be int32"),
        ({"kv": kv[:, :576].contiguous()}, "kv shape \\(40, 576\\): expected \\[..., 656\\]"),
        ({"sm_scale": 0.0}, "sm_scale=0.0"),
        ({"q": q[..., :512].contiguous()}, "q head dim 512: expected 512 \\+ 64 = 576"),
    ]
    for change, message in cases:
        args = {"q": q, "kv": kv, "rows": rows, "sm_scale": 0.1, **change}
        with pytest.raises(ValueError, match=message):
            cluster.sparse_mla_decode_fp8_cluster(**args)
    monkeypatch.setattr(cluster, "GLUON_IMPORT_ERROR", "ImportError: no cluster")
    assert cluster.cluster_unsupported(q, kv).endswith("has no usable Gluon (ImportError: no cluster)")
    assert cluster.cluster_unsupported(q[:, :64], kv).startswith("64 heads")     # heads named first


def test_cluster_launches_with_todays_split_plan_and_arguments(monkeypatch):
    """Where it can run (faked here), the launcher passes what `_launch_gluon` passes today's kernel, for the
    same split plan (chunk, splits, partial buffers' strides), plus the cluster's launch options: grid (1, N,
    splits) clusters of 2 CTAs."""
    launches = {}

    class Record:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches[self.name] = (grid, [a if not torch.is_tensor(a) else (a.shape, a.stride(), a.dtype)
                                              for a in args], kwargs)
            return launch

    monkeypatch.setattr(cluster, "_sparse_mla_decode_fp8_cluster_kernel", Record("cluster"))
    monkeypatch.setattr(fp8, "_sparse_mla_decode_fp8_gluon_kernel", Record("gluon"))
    monkeypatch.setattr(cluster, "cluster_unsupported", lambda q, kv: None)
    monkeypatch.setattr(dsa, "combine_splits", lambda *args: None)
    monkeypatch.setattr(fp8, "combine_splits", lambda *args: None)
    q, kv, rows = cluster_inputs(3, k=333)
    base = torch.arange(3, dtype=torch.int64)
    for splits in (1, 3, 7):
        for row_base in (None, base):
            launches.clear()
            out = torch.empty(3, 128, 512, dtype=torch.bfloat16)
            lse = torch.empty(3, 128)
            cluster.sparse_mla_decode_fp8_cluster(q, kv, rows, 0.1, row_base=row_base, num_splits=splits, out=out,
                                                  lse=lse)
            fp8._launch_gluon(q, kv, rows, row_base, out, lse, 0.1, splits)
            (c_grid, c_args, c_kw), (g_grid, g_args, g_kw) = launches["cluster"], launches["gluon"]
            assert c_grid == (1,) + tuple(g_grid[1:]) and g_grid[0] == 2      # the two head blocks: one cluster
            assert c_args == g_args, f"splits {splits}"
            assert c_kw == {"HAS_ROW_BASE": row_base is not None, "K_OFF": cluster.K_OFF, "BAR_OFF": cluster.BAR_OFF,
                            "num_warps": 8, "num_ctas": 2}
            assert g_kw["BLOCK_H"] * 2 == cluster.HEADS and g_kw["BLOCK_K"] == cluster.BLOCK_K
            assert g_kw["NUM_STAGES"] == cluster.NUM_STAGES and g_kw["num_warps"] == cluster.NUM_WARPS


def test_cluster_constants_agree_with_the_row_format_and_todays_kernel():
    """The byte counts the mbarriers expect and the row offsets the kernel reads, against hisparse.dsa.fp8."""
    assert cluster.BLOCK_BYTES == cluster.HALF_K * fp8.TILE * 2 == 8192
    assert cluster.HALF_K * 2 == cluster.BLOCK_K == fp8.GLUON_FP8_TILES.block_k
    assert cluster.SCALE_WORD * 4 == fp8.SCALE_BYTE and cluster.ROPE_HALF * 2 == fp8.ROPE_BYTE
    assert cluster.HEADS == 2 * fp8.GLUON_FP8_TILES.block_h
    assert isinstance(cluster.K_OFF, int) and isinstance(cluster.BAR_OFF, int) and cluster.BAR_OFF % 8 == 0


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def needs_cluster():
    """Skip where the cluster kernel cannot run; else, once, `--smoke` in a subprocess with a time limit: the
    shared offsets the inline PTX assumes against this Triton's allocation, and one small launch bitwise equal to
    today's kernel. Its failure fails every GPU test here rather than hanging the run."""
    probe = torch.empty(1, 128, 576, dtype=torch.bfloat16, device="cuda")
    reason = cluster.cluster_unsupported(probe, torch.empty(1, 656, dtype=torch.uint8, device="cuda"))
    if reason:
        pytest.skip(f"the cluster FP8 kernel cannot run here: {reason}")
    try:
        run = subprocess.run([sys.executable, "-m", "experiments.tools.gluon_fp8_cluster", "--smoke"],
                             capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"--smoke did not finish in 240 s (a hang: barrier or offset?): {exc.stdout} {exc.stderr}")
    if run.returncode != 0:
        pytest.fail(f"--smoke failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")


def assert_bitwise(got, ref, what: str):
    out, lse = got
    ref_out, ref_lse = ref
    assert torch.equal(lse, ref_lse), f"{what}: lse differs, max {(lse - ref_lse).abs().nan_to_num().max():.3g}"
    assert torch.equal(out, ref_out), f"{what}: out differs, max {(out.float() - ref_out.float()).abs().max():.3g}"


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_cluster")
@pytest.mark.parametrize("n,k", [(1, 2048), (3, 2048), (64, 2048), (3, 1999), (64, 1999)],
                         ids=["N1-k2048", "N3-k2048", "N64-k2048", "N3-k1999", "N64-k1999"])
@pytest.mark.parametrize("splits", [None, 1, 3, 7], ids=["splits-auto", "splits1", "splits3", "splits7"])
def test_gpu_cluster_equals_todays_gluon_fp8_kernel_bitwise(n, k, splits):
    """out and lse bit for bit today's Gluon FP8 kernel's, every element written (out and lse poisoned with NaN);
    -1 rows scattered (about 10%), request 1 from position 1000 on, request 2 all; k 1999 ends on a 15-row tile.
    Both within the bf16 tolerance of the torch reference, the empty request zeros and -inf."""
    q, kv, rows = gluon_fp8_inputs(n, 128, k)
    out = torch.full((n, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((n, 128), float("nan"), device="cuda")
    got = cluster.sparse_mla_decode_fp8_cluster(q, kv, rows, DSV32_SCALE, num_splits=splits, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    ref = fp8.sparse_mla_decode_fp8(q, kv, rows, DSV32_SCALE, num_splits=splits, backend="gluon")
    assert_bitwise((out, lse), ref, f"n {n} k {k} splits {splits}")
    ref_out, ref_lse = fp8.sparse_mla_decode_fp8_ref(q, kv, rows, DSV32_SCALE)
    assert rel_err(out, ref_out) < TOL[torch.bfloat16] and rel_err(lse, ref_lse) < 1e-4
    if n > 2:
        assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isinf(lse[2]).all() and (lse[2] < 0).all()


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_cluster")
@pytest.mark.parametrize("splits", [1, 7], ids=["splits1", "splits7"])
def test_gpu_cluster_with_row_base_and_repeated_launches(splits):
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
    res = cluster.sparse_mla_decode_fp8_cluster(q, kv_res, rows_res, DSV32_SCALE, num_splits=splits)
    for _ in range(3):
        hot = cluster.sparse_mla_decode_fp8_cluster(q, kv_hot, rows_hot, DSV32_SCALE, row_base=base,
                                                    num_splits=splits)
        assert_bitwise(hot, ref_hot, "row_base against today's kernel")
        assert_bitwise(hot, res, "row_base against the resident rows")


@pytest.mark.gpu
@pytest.mark.usefixtures("needs_cluster")
@pytest.mark.parametrize("splits", [1, 3], ids=["splits1", "splits3"])
def test_gpu_cluster_graphed_equals_eager(splits):
    """Captured once in a CUDA graph (splits 3: partial buffers and the combine inside it), replayed over new rows
    copied into the captured tensors: each replay bitwise the eager launch over the same inputs."""
    q, kv, rows = gluon_fp8_inputs(16, 128, 2048, context=8192)
    static_q, static_rows = q.clone(), rows.clone()
    out = torch.empty(16, 128, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(16, 128, device="cuda")
    cluster.sparse_mla_decode_fp8_cluster(static_q, kv, static_rows, DSV32_SCALE, num_splits=splits, out=out,
                                          lse=lse)                                # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cluster.sparse_mla_decode_fp8_cluster(static_q, kv, static_rows, DSV32_SCALE, num_splits=splits, out=out,
                                              lse=lse)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for step in range(3):
        new_rows = rows[torch.randperm(16, device="cuda", generator=gen)]      # other requests' rows and -1s
        static_rows.copy_(new_rows)
        static_q.copy_(q * (1 + step))
        graph.replay()
        torch.cuda.synchronize()
        eager = cluster.sparse_mla_decode_fp8_cluster(q * (1 + step), kv, new_rows, DSV32_SCALE, num_splits=splits)
        assert_bitwise((out, lse), eager, f"replay {step}")
        assert_bitwise(eager, fp8.sparse_mla_decode_fp8(q * (1 + step), kv, new_rows, DSV32_SCALE,
                                                        num_splits=splits, backend="gluon"), f"eager {step}")
