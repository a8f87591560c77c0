"""Launcher, offline compile check, smoke test and timing of the 2-CTA cluster, warp-specialised Gluon FP8 decode
kernel (kernels_triton/dsa_fp8_gluon_x2.py, its docstring for the scheme), a prototype of issue 36 kept here until
it is measured on a GPU; if it is exact and faster, its launcher moves into hisparse/dsa/fp8.py (128 heads) and the
rest goes.

    TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.gluon_fp8_x2          # offline sm_90a compile
    timeout 300 python -m experiments.tools.gluon_fp8_x2 --smoke                       # on a Hopper GPU, first
    python -m experiments.tools.gluon_fp8_x2 --time [--batches 64 128]                 # on a Hopper GPU
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import torch

from hisparse.dsa import fp8
from hisparse.dsa import ops as dsa
from kernels_triton.dsa_fp8_gluon_x2 import (
    BAR_OFF, D_V, GLUON_IMPORT_ERROR, HEADS, K_OFF, NUM_CTAS, NUM_WARPS, _sparse_mla_decode_fp8_x2_kernel)


def sparse_mla_decode_fp8_x2(q, kv, rows, sm_scale: float, row_base=None, num_splits: int | None = None):
    """`sparse_mla_decode_fp8(q, kv, rows, sm_scale, num_splits, row_base=row_base, backend="gluon")` through the
    cluster kernel (the same checks and split plan; 128 heads only): (out [N, 128, 512] bf16, lse [N, 128])."""
    fp8._check_fp8_decode_inputs(q, kv, rows, sm_scale, None, None, row_base)
    dsa._require(q.shape[1] == HEADS, f"{q.shape[1]} heads: the cluster kernel runs exactly {HEADS}")
    reason = fp8.fp8_gluon_unsupported(q, kv)
    dsa._require(reason is None, f"the cluster FP8 decode kernel cannot run this: {reason}")
    n, h, _ = q.shape
    out = torch.empty((n, h, D_V), dtype=q.dtype, device=q.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=q.device)
    k = rows.shape[1]
    chunk, splits = dsa.split_plan(n, h, k, fp8.GLUON_FP8_TILES, q.device, num_splits)
    part, part_lse, split_strides = dsa.split_buffers(out, lse, splits)
    _sparse_mla_decode_fp8_x2_kernel[(1, n, splits)](
        q, kv.view(fp8.FP8), kv.view(torch.float32), kv.view(torch.bfloat16), rows,
        rows if row_base is None else row_base, part, part_lse,
        q.stride(0), q.stride(1), kv.stride(0) // 16, rows.stride(0), part.stride(0), part.stride(1),
        split_strides[0], part_lse.stride(0), part_lse.stride(1), split_strides[1],
        h, k, chunk, sm_scale * 1.4426950408889634,
        HAS_ROW_BASE=row_base is not None, K_OFF=K_OFF, BAR_OFF=BAR_OFF,
        num_warps=NUM_WARPS, num_ctas=NUM_CTAS,
    )
    if splits > 1:
        dsa.combine_splits(part, part_lse, out, lse)
    return out, lse


POINTER_TYPES = {"q_ptr": "*bf16", "kv8_ptr": "*fp8e4nv", "kv32_ptr": "*fp32", "kv16_ptr": "*bf16",
                 "rows_ptr": "*i32", "row_base_ptr": "*i64", "out_ptr": "*bf16", "lse_ptr": "*fp32"}
ALIGNED = ("stride_qn", "stride_qh", "stride_rn", "stride_on", "stride_oh")


def compile_offline(row_base: bool):
    from experiments.tools.sass_dsa_gluon import compile_gluon_sm90
    kernel = _sparse_mla_decode_fp8_x2_kernel
    sig = {name: POINTER_TYPES.get(name) or ("fp32" if name == "qk_scale_log2" else
                                            "constexpr" if name in ("HAS_ROW_BASE", "K_OFF", "BAR_OFF") else "i32")
           for name in kernel.arg_names}
    names = list(sig)
    divisible = [i for i, t in enumerate(sig.values()) if t.startswith("*")] + [names.index(n) for n in ALIGNED]
    constexprs = {"HAS_ROW_BASE": row_base, "K_OFF": K_OFF, "BAR_OFF": BAR_OFF}
    return compile_gluon_sm90(kernel, sig, constexprs, divisible, num_warps=NUM_WARPS, num_ctas=NUM_CTAS)


def allocation_offsets(row_base: bool) -> dict[str, int]:
    """{buffer: allocation.offset} from the MLIR dump of a compile in a subprocess (the dump goes to stderr)."""
    env = dict(os.environ, MLIR_ENABLE_DUMP="1", TRITON_ALWAYS_COMPILE="1", TRITON_INTERPRET="0")
    code = f"from experiments.tools import gluon_fp8_x2 as m; m.compile_offline({row_base})"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the compile for the MLIR dump failed:\n{run.stderr[-3000:]}")
    found = re.findall(r"(%\w+) = ttg\.local_alloc[^{\n]*\{allocation\.offset = (\d+)", run.stderr)
    return {name: int(off) for name, off in found}


def check_offsets(row_base: bool) -> dict[str, int]:
    offsets = allocation_offsets(row_base)
    got = {"%k_nope": offsets.get("%k_nope"), "%bars": offsets.get("%bars")}
    if got != {"%k_nope": K_OFF, "%bars": BAR_OFF}:
        raise SystemExit(f"row_base {row_base}: Triton placed K nope at {got['%k_nope']} and the mbarriers at "
                         f"{got['%bars']}; the asm assumes K_OFF {K_OFF}, BAR_OFF {BAR_OFF} (all: {offsets})")
    return offsets


def offline() -> None:
    from experiments.tools.sass import registers_and_spills
    from experiments.tools.sass_dsa_fp8_gluon import partitions
    from experiments.tools.sass_dsa_gluon import hgmma_shapes, sass_text
    if GLUON_IMPORT_ERROR is not None:
        raise SystemExit(f"no usable Gluon ({GLUON_IMPORT_ERROR})")
    for row_base in (False, True):
        offsets = check_offsets(row_base)
        compiled = compile_offline(row_base)
        regs, spills = registers_and_spills(compiled)
        sass = sass_text(compiled)
        print(f"row_base {row_base}: offsets {offsets}; {regs} registers, {spills} B spilled, "
              f"{compiled.metadata.shared} B shared, num_ctas {compiled.metadata.num_ctas} | {partitions(sass)} | "
              f"HGMMA {hgmma_shapes(compiled)} | st.async {len(re.findall('STAS', sass))}")


def same_bits(a, b) -> bool:
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype]))


def smoke(n: int = 3, k: int = 333, seed: int = 0) -> bool:
    """Offsets as this machine's Triton places them, then small launches (a short last tile, -1 rows, a request
    without any, splits 1 and 3) against today's Gluon FP8 kernel: max |out diff| and lse diff (the row sums are
    summed per tile here, per thread there: float32 rounding apart, not bitwise)."""
    for row_base in (False, True):
        check_offsets(row_base)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    latent = torch.randn(n * 4096, 512, device="cuda", generator=gen).bfloat16()
    rope = torch.randn(n * 4096, 64, device="cuda", generator=gen).bfloat16()
    kv = fp8.quantize_rows(latent, rope)
    rows = torch.stack([torch.randperm(4096, device="cuda", generator=gen)[:k] + i * 4096 for i in range(n)])
    rows = rows.to(torch.int32)
    rows[torch.rand(n, k, device="cuda", generator=gen) < 0.1] = -1
    rows[-1] = -1
    q = (torch.randn(n, 128, 576, device="cuda", generator=gen) * 0.3).bfloat16()
    ok = True
    for splits in (1, 3):
        ref = fp8.sparse_mla_decode_fp8(q, kv, rows, 0.1, num_splits=splits, backend="gluon")
        got = sparse_mla_decode_fp8_x2(q, kv, rows, 0.1, num_splits=splits)
        torch.cuda.synchronize()
        diff = (ref[0].float() - got[0].float()).abs().nan_to_num(float("inf")).max().item()
        ldiff = (ref[1] - got[1]).nan_to_num(0.0).abs().max().item()
        good = diff <= 1e-2 and ldiff <= 1e-4 and bool((torch.isinf(ref[1]) == torch.isinf(got[1])).all())
        print(f"smoke n {n} k {k} splits {splits}: max |out diff| {diff:.3g}, |lse diff| {ldiff:.3g}, bitwise "
              f"{same_bits(ref[0], got[0]) and same_bits(ref[1], got[1])}: {'ok' if good else 'WRONG'}", flush=True)
        ok = ok and good
    return ok


def time_against_gluon(batches=(64, 128), k: int = 2048, context: int = 8192, seed: int = 0) -> None:
    from benchmarks.bench_attention_dsa import SM_SCALE, make_inputs, work
    from benchmarks.common import HBM_BYTES_PER_S, MMA_FLOPS_PER_S, time_us
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for batch in batches:
        q, kv, rows = make_inputs(batch, context, HEADS, k, torch.device("cuda"), gen)
        stored = fp8.to_rows(kv)
        flops, nbytes = work(batch, HEADS, k, fp8.ROW_BYTES)
        roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
        ref = fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="gluon")
        got = sparse_mla_decode_fp8_x2(q, stored, rows, SM_SCALE)
        diff = (ref[0].float() - got[0].float()).abs().max().item()
        kernels = {"gluon_fp8": lambda: fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="gluon")[0],
                   "gluon_fp8_x2": lambda: sparse_mla_decode_fp8_x2(q, stored, rows, SM_SCALE)[0],
                   "bf16_gluon": lambda: dsa.sparse_mla_decode(q, kv, rows, SM_SCALE, backend="gluon")[0]}
        base = None
        for name, fn in kernels.items():
            us, p20, p80 = time_us(fn, cudagraph=True)
            base = base or us
            print(f"batch {batch:4d} heads {HEADS} k {k}: {name:14s} {us:8.1f} us (p20 {p20:.1f}, p80 {p80:.1f})  "
                  f"roofline_frac {roofline_us / us:.3f}  x{base / us:.3f} of gluon_fp8", flush=True)
        print(f"batch {batch:4d}: max |out diff| against gluon_fp8 {diff:.3g}", flush=True)
        del q, kv, stored, rows, ref, got
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="on a Hopper GPU, under `timeout`: one small launch")
    ap.add_argument("--time", action="store_true", help="on a Hopper GPU: time against today's Gluon FP8 kernel")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    args = ap.parse_args(argv)
    if args.smoke:
        raise SystemExit(0 if smoke() else 1)
    if args.time:
        time_against_gluon(args.batches)
        return
    offline()


if __name__ == "__main__":
    main()
