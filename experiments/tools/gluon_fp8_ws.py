"""Launch, offline compile check, smoke test and timing of the warp-specialised Gluon FP8 decode kernel
(kernels_triton/dsa_fp8_gluon_ws.py, its docstring for the scheme), a prototype of issue 36 kept here until it is
measured on a GPU (results/notes/fp8.md, "Left"). It takes the Gluon FP8 kernel's arguments, so it runs through
that kernel's launcher: `ws_kernel()` swaps it in for `sparse_mla_decode_fp8(..., backend="gluon")`. If it is
exact and faster, it replaces that kernel in kernels_triton/dsa_fp8_gluon.py and this file goes.

    TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.gluon_fp8_ws      # offline sm_90a compile
    timeout 300 python -m experiments.tools.gluon_fp8_ws --smoke                   # on a Hopper GPU, first
    python -m experiments.tools.gluon_fp8_ws --time [--batches 64 128]             # on a Hopper GPU
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re

import torch

from hisparse.dsa import fp8
from kernels_triton import dsa_fp8_gluon_ws as ws


class WithOverlap:
    """The warp-specialised kernel with OVERLAP added to every launch."""

    def __init__(self, kernel, overlap: bool, probe: int = 0, prefetch: int = 1):
        self.kernel, self.overlap, self.probe, self.prefetch = kernel, overlap, probe, prefetch

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, OVERLAP=self.overlap, PROBE=self.probe,
                                                  PREFETCH=self.prefetch)


@contextlib.contextmanager
def ws_kernel(overlap: bool = False, probe: int = 0, prefetch: int = 1):
    """Inside: `sparse_mla_decode_fp8(..., backend="gluon")` (its checks, split plan and arguments) launches the
    warp-specialised kernel, with QK^T of the next tile beside this tile's softmax or not (`overlap`, the
    kernel's OVERLAP); today's kernel is back on the way out, whatever happened inside."""
    today = fp8._sparse_mla_decode_fp8_gluon_kernel
    fp8._sparse_mla_decode_fp8_gluon_kernel = WithOverlap(ws._sparse_mla_decode_fp8_ws_kernel, overlap, probe, prefetch)
    try:
        yield
    finally:
        fp8._sparse_mla_decode_fp8_gluon_kernel = today


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same bits (torch.equal compares values: it takes -0.0 for 0.0)."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype]))


def decode_ws(q, kv, rows, sm_scale: float, overlap: bool = False, probe: int = 0, prefetch: int = 1,
              **kwargs):
    """`sparse_mla_decode_fp8(q, kv, rows, sm_scale, backend="gluon", **kwargs)` through the warp-specialised
    kernel (`overlap`: `ws_kernel`'s): the same refusals (ValueError before any launch), outputs and, meant bit
    for bit, values."""
    with ws_kernel(overlap, probe, prefetch):
        return fp8.sparse_mla_decode_fp8(q, kv, rows, sm_scale, backend="gluon", **kwargs)


# ---------------------------------------------------------------------------------------------
# Offline compile (no GPU): TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.gluon_fp8_ws
# ---------------------------------------------------------------------------------------------

def compile_offline(row_base: bool, overlap: bool):
    """The kernel compiled for sm_90a (Triton 3.6) as `_launch_gluon` specialises it, with OVERLAP."""
    from experiments.tools.sass_dsa_fp8_gluon import compile_fp8_gluon
    return compile_fp8_gluon(row_base, ws._sparse_mla_decode_fp8_ws_kernel, OVERLAP=overlap)


def partitions(sass: str) -> dict[str, tuple[int, int, int]]:
    """{partition: (registers it runs at, instructions, local loads and stores)} from the SASS: the producer's
    code runs between its setmaxnreg up and its drop back to the idle count, the consumers' between their
    drop for the region and their return."""
    lines = sass.splitlines()
    marks = [(i, kind, int(regs, 16)) for i, line in enumerate(lines)
             for kind, regs in re.findall(r"USETMAXREG\.(\w+)\.CTAPOOL[^,;]*,? ?(0x[0-9a-f]+)", line)]
    if len(marks) != 6:
        raise SystemExit(f"expected 6 setmaxnreg (idle, producer in and out, consumers' parent, region, return), "
                         f"got {[(k, r) for _, k, r in marks]}")
    spans = {"producer": (marks[1], marks[2]), "consumers": (marks[4], marks[5])}
    found = {}
    for name, ((start, _, regs), (stop, _, _)) in spans.items():
        body = [line for line in lines[start:stop] if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        local = sum(bool(re.search(r"\b(STL|LDL)\b", line)) for line in body)
        found[name] = (regs, len(body), local)
    return found


def offline(ptx_dir: str | None = None) -> None:
    import triton

    from experiments.tools.sass import registers_and_spills
    from experiments.tools.sass_dsa_gluon import hgmma_shapes, sass_text
    if ws.GLUON_IMPORT_ERROR is not None:
        raise SystemExit(f"Triton {triton.__version__}: no usable Gluon ({ws.GLUON_IMPORT_ERROR})")
    if not triton.__version__.startswith("3.6"):
        raise SystemExit(f"Triton {triton.__version__}: the kernel is written for Triton 3.6's Gluon (the GPU "
                         "machine's); compile with it, e.g. TRITON_INTERPRET=0 /tmp/t36/bin/python -m "
                         "experiments.tools.gluon_fp8_ws")
    print(f"Triton {triton.__version__}, sm_90a, {ws.NUM_WARPS} consumer warps + {ws.PRODUCER_WARPS} producer "
          f"warps, BLOCK_H {ws.BLOCK_H}, BLOCK_K {ws.BLOCK_K}, {ws.NUM_BUFFERS} K buffers")
    for overlap, row_base in itertools.product((True, False), (False, True)):
        compiled = compile_offline(row_base, overlap)
        sass = sass_text(compiled)
        if ptx_dir:
            os.makedirs(ptx_dir, exist_ok=True)
            tag = f"fp8_gluon_ws_overlap{int(overlap)}_rb{int(row_base)}"
            for ext in ("ttgir", "llir", "ptx"):
                with open(os.path.join(ptx_dir, f"{tag}.{ext}"), "w") as f:
                    f.write(compiled.asm[ext])
            with open(os.path.join(ptx_dir, f"{tag}.sass"), "w") as f:
                f.write(sass)
        regs, spills = registers_and_spills(compiled)
        parts = ", ".join(f"{name} at {r} registers, {n} instructions, {local} local loads/stores"
                          for name, (r, n, local) in partitions(sass).items())
        shared = compiled.metadata.shared
        print(f"  overlap {'on ' if overlap else 'off'} row_base {'on ' if row_base else 'off'}: launched at {regs} "
              f"registers, {spills} B spilled, {shared // 1024} KiB shared ({shared} B), "
              f"{compiled.metadata.num_warps} warps | {parts} | HGMMA shapes: {hgmma_shapes(compiled)}")


# ---------------------------------------------------------------------------------------------
# On a Hopper GPU: --smoke (first, under a time limit) and --time
# ---------------------------------------------------------------------------------------------

def smoke(n: int = 3, k: int = 333, seed: int = 0) -> bool:
    """One small launch (n requests, k rows: a short last tile, -1 rows, a request without any) at 128 and 96
    heads, splits 1 and 3, with and without OVERLAP, against today's Gluon FP8 kernel; prints and returns whether
    out and lse are bitwise equal. Run it in a process with a time limit: a wrong barrier phase hangs the GPU until
    it is killed."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    latent = torch.randn(n * 4096, 512, device="cuda", generator=gen).bfloat16()
    rope = torch.randn(n * 4096, 64, device="cuda", generator=gen).bfloat16()
    kv = fp8.quantize_rows(latent, rope)
    rows = torch.stack([torch.randperm(4096, device="cuda", generator=gen)[:k] + i * 4096 for i in range(n)])
    rows = rows.to(torch.int32)
    rows[torch.rand(n, k, device="cuda", generator=gen) < 0.1] = -1
    rows[-1] = -1
    ok = True
    for heads in (128, 96):
        q = (torch.randn(n, heads, 576, device="cuda", generator=gen) * 0.3).bfloat16()
        for splits, overlap in itertools.product((1, 3), (True, False)):
            ref = fp8.sparse_mla_decode_fp8(q, kv, rows, 0.1, num_splits=splits, backend="gluon")
            got = decode_ws(q, kv, rows, 0.1, overlap, num_splits=splits)
            torch.cuda.synchronize()
            same = same_bits(ref[0], got[0]) and same_bits(ref[1], got[1])
            diff = (ref[0].float() - got[0].float()).abs().nan_to_num(float("inf")).max().item()
            print(f"smoke n {n} heads {heads} k {k} splits {splits} overlap {overlap}: bitwise equal {same} "
                  f"(max |out diff| {diff:.3g})", flush=True)
            ok = ok and same
    return ok


def time_against_gluon(batches=(64, 128), heads: int = 128, k: int = 2048, context: int = 8192,
                       seed: int = 0) -> None:
    """k rows over a pool of batch * context FP8 rows (bench_attention_dsa's make_inputs): us (CUDA graphs,
    benchmarks/common.py's time_us) and roofline fraction over 656-byte rows of today's Gluon FP8 kernel and of
    the warp-specialised one without and with OVERLAP, and whether their outputs are bitwise equal."""
    from benchmarks.bench_attention_dsa import SM_SCALE, make_inputs, work
    from benchmarks.common import HBM_BYTES_PER_S, MMA_FLOPS_PER_S, time_us
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for batch in batches:
        q, kv, rows = make_inputs(batch, context, heads, k, torch.device("cuda"), gen)
        stored = fp8.to_rows(kv)
        flops, nbytes = work(batch, heads, k, fp8.ROW_BYTES)
        roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
        ref = fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="gluon")
        from hisparse.dsa import ops as dsa
        kv_bf16 = kv                      # the bf16 Gluon kernel over the same rows' bf16 values: the bar's kernel
        bf16_gluon = lambda: dsa.sparse_mla_decode(q, kv_bf16, rows, SM_SCALE, backend="gluon")[0]  # noqa: E731
        same = {overlap: all(same_bits(a, b) for a, b in zip(ref, decode_ws(q, stored, rows, SM_SCALE, overlap)))
                for overlap in (True, False)}
        print("prefetch 0/1/2/3 bitwise:", [all(same_bits(a, b) for a, b in zip(ref, decode_ws(q, stored, rows, SM_SCALE,
              False, 0, pf))) for pf in (0, 1, 2, 3)], flush=True)
        kernels = {"gluon_fp8": lambda: fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="gluon")[0],
                   "gluon_fp8_ws": lambda: decode_ws(q, stored, rows, SM_SCALE, False)[0],
                   "gluon_fp8_ws_no_prefetch": lambda: decode_ws(q, stored, rows, SM_SCALE, False, 0, 0)[0],
                   "gluon_fp8_ws_prefetch_lines": lambda: decode_ws(q, stored, rows, SM_SCALE, False, 0, 2)[0],
                   "gluon_fp8_ws_prefetch_lines_2": lambda: decode_ws(q, stored, rows, SM_SCALE, False, 0, 3)[0],
                   "probe_cached_rows": lambda: decode_ws(q, stored, rows, SM_SCALE, False, 1, 2)[0],
                   "probe_half_convert": lambda: decode_ws(q, stored, rows, SM_SCALE, False, 2, 2)[0],
                   "bf16_gluon": lambda: bf16_gluon()}
        base = None
        for name, fn in kernels.items():
            us, p20, p80 = time_us(fn, cudagraph=True)
            base = base or us
            print(f"batch {batch:4d} heads {heads} k {k} context {context}: {name:20s} {us:8.1f} us "
                  f"(p20 {p20:.1f}, p80 {p80:.1f})  roofline_frac {roofline_us / us:.3f}  "
                  f"x{base / us:.3f} of gluon_fp8", flush=True)
        print(f"batch {batch:4d}: bitwise equal to gluon_fp8: gluon_fp8_ws {same[False]}, gluon_fp8_ws_overlap "
              f"{same[True]}", flush=True)
        del q, kv, stored, rows, ref, kv_bf16
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="on a Hopper GPU: one small launch against today's Gluon "
                    "FP8 kernel (exit status 1 unless bitwise equal); run it under `timeout`")
    ap.add_argument("--time", action="store_true", help="on a Hopper GPU: time against today's Gluon FP8 kernel")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128], help="--time's batches (default 64 128)")
    ap.add_argument("--context", type=int, default=8192, help="pool rows per request for --time (default %(default)s)")
    ap.add_argument("--ptx", metavar="DIR", help="offline: also write the ttgir/llir/ptx/sass there")
    args = ap.parse_args(argv)
    if args.smoke:
        raise SystemExit(0 if smoke() else 1)
    if args.time:
        time_against_gluon(args.batches, context=args.context)
        return
    offline(args.ptx)


if __name__ == "__main__":
    main()
