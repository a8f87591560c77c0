"""GPU probe (Hopper, Triton 3.6) of the Gluon FP8 decode kernel's DEQUANT modes and THREAD_SUMS
(kernels_triton/dsa_fp8_gluon.py): bits against the default ("f32", row sums per element), error against the
torch reference, and graphed time at bench_attention_dsa's shape (128 heads, k 2048). An open question of
issue 36 (results/notes/fp8.md): once measured, the winner becomes the kernel's default and this file goes.

    python -m experiments.tools.gluon_fp8_modes [--batches 64 128] [--no-time]

The launcher (hisparse.dsa.fp8._launch_gluon) passes neither constexpr, so each launch here goes through
`sparse_mla_decode_fp8(..., backend="gluon")` with the module's kernel wrapped to add them.
Expected: "swizzled" and "bf16x2" without THREAD_SUMS equal the default bit for bit (same K tile, same
order), here and with latents scaled so that scales exceed 2 ** 7 (bf16x2's second multiply); with
THREAD_SUMS the three modes equal one another bit for bit and the default within float32 rounding of l.
"""
import argparse
import contextlib

import torch

from benchmarks.bench_attention_dsa import FULL, SM_SCALE, make_inputs, work
from benchmarks.common import HBM_BYTES_PER_S, MMA_FLOPS_PER_S, time_us
from hisparse.dsa import fp8
from kernels_triton import dsa_fp8_gluon as fg

VARIANTS = [(mode, ts) for ts in (False, True) for mode in fg.GLUON_FP8_DEQUANT]


class WithModes:
    """The Gluon FP8 kernel with DEQUANT and THREAD_SUMS added to every launch."""

    def __init__(self, kernel, dequant: int, thread_sums: bool):
        self.kernel, self.extra = kernel, {"DEQUANT": dequant, "THREAD_SUMS": thread_sums}

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, **self.extra)


@contextlib.contextmanager
def variant(mode: str, thread_sums: bool):
    kernel = fp8._sparse_mla_decode_fp8_gluon_kernel
    fp8._sparse_mla_decode_fp8_gluon_kernel = WithModes(kernel, fg.GLUON_FP8_DEQUANT[mode], thread_sums)
    try:
        yield
    finally:
        fp8._sparse_mla_decode_fp8_gluon_kernel = kernel


def name(mode, ts):
    return f"{mode}{' +thread_sums' if ts else ''}"


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(batch, k, context, gen, latent_gain=1.0, empty_rows=True):
    q, kv, rows = make_inputs(batch, context, FULL["heads"], k, torch.device("cuda"), gen)
    kv = kv.float()
    kv[:, :512] *= latent_gain                 # gain 2 ** 20: scales about 2 ** 13 (over bf16x2's 2 ** 7)
    stored = fp8.to_rows(kv.bfloat16())
    if empty_rows:
        rows[torch.rand(rows.shape, device="cuda", generator=gen) < 0.1] = -1
        if batch > 1:
            rows[1, k // 2:] = -1
        if batch > 2:
            rows[2] = -1
    return q, stored, rows


def check(batch, k, gen, latent_gain=1.0, row_base=False):
    q, kv, rows = inputs(batch, k, 8192, gen, latent_gain)
    kw = {}
    if row_base:             # the same rows at an offset per request (HAS_ROW_BASE)
        base = torch.arange(batch, dtype=torch.int64, device="cuda") * 3
        kv = torch.cat([torch.zeros(3 * batch, kv.shape[1], dtype=kv.dtype, device="cuda"), kv])
        rows = torch.where(rows >= 0, rows + 3 * batch - base[:, None].int(), rows)
        kw["row_base"] = base
    ref_out, ref_lse = fp8.sparse_mla_decode_fp8_ref(q, kv, rows, SM_SCALE, **kw)
    for splits in (1, 7):
        got = {}
        for mode, ts in VARIANTS:
            with variant(mode, ts):
                got[mode, ts] = fp8.sparse_mla_decode_fp8(q, kv, rows, SM_SCALE, num_splits=splits, backend="gluon",
                                                          **kw)
        d_out, d_lse = got["f32", False]
        tag = f"batch {batch} k {k} gain {latent_gain:g} row_base {row_base} splits {splits}"
        print(f"{tag}: default rel err {rel_err(d_out, ref_out):.2e} (lse {rel_err(d_lse, ref_lse):.1e})")
        for (mode, ts), (out, lse) in got.items():
            same = torch.equal(out, d_out) and torch.equal(lse, d_lse)
            first_ts = got["f32", True]
            same_ts = torch.equal(out, first_ts[0]) and torch.equal(lse, first_ts[1])
            expected = same if not ts else same_ts
            print(f"  {name(mode, ts):24s} bitwise default {same!s:5s} bitwise f32+thread_sums {same_ts!s:5s} "
                  f"out vs default {rel_err(out, d_out):.1e}, lse max diff {(lse - d_lse).abs().nan_to_num().max():.1e}, "
                  f"vs ref {rel_err(out, ref_out):.2e}{'' if expected else '  UNEXPECTED'}")


def time_all(batch, gen):
    q, kv, rows = inputs(batch, FULL["k"], FULL["contexts"][0], gen, empty_rows=False)
    flops, nbytes = work(batch, FULL["heads"], FULL["k"], fp8.ROW_BYTES)
    roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
    base = None
    for mode, ts in VARIANTS:
        with variant(mode, ts):
            us = time_us(lambda: fp8.sparse_mla_decode_fp8(q, kv, rows, SM_SCALE, backend="gluon"), cudagraph=True)[0]
        base = base or us
        print(f"batch {batch}: {name(mode, ts):24s} {us:8.1f} us  roofline_frac {roofline_us / us:.3f}  "
              f"x{base / us:.3f} of the default")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--no-time", action="store_true")
    args = ap.parse_args()
    q = torch.empty(1, 128, 576, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    reason = fp8.fp8_gluon_unsupported(q, torch.empty(1, fp8.ROW_BYTES, dtype=torch.uint8, device=q.device))
    if reason is not None:
        raise SystemExit(f"the Gluon FP8 kernel cannot run here: {reason}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    check(4, 2048, gen)
    check(3, 333, gen)                           # a short last tile
    check(4, 2048, gen, latent_gain=2.0 ** 20)   # scales over 2 ** 7
    check(4, 1999, gen, row_base=True)
    if not args.no_time:
        for batch in args.batches:
            time_all(batch, gen)


if __name__ == "__main__":
    main()
