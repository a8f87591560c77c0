"""Launcher, offline compile check, smoke test and timing of the 2-CTA cluster Gluon FP8 decode kernel
(kernels_triton/dsa_fp8_gluon_cluster.py, its docstring for the scheme), a prototype of issue 36 kept here until
it is measured on a GPU (results/notes/fp8.md, "Left"); if it is exact and faster, the launcher moves into
hisparse/dsa/fp8.py behind `sparse_mla_decode_fp8(backend="gluon")` and the rest goes.

    TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.gluon_fp8_cluster          # offline sm_90a compile
    timeout 300 python -m experiments.tools.gluon_fp8_cluster --smoke                       # on a Hopper GPU, first
    python -m experiments.tools.gluon_fp8_cluster --time [--batches 64 128]                 # on a Hopper GPU
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

import torch

from hisparse.dsa import fp8
from hisparse.dsa import ops as dsa
from kernels_triton.dsa_fp8_gluon_cluster import (  # noqa: F401 -- constants re-exported for the tests
    BAR_OFF, BLOCK_BYTES, BLOCK_K, D_V, GLUON_IMPORT_ERROR, HALF_K, HEADS, K_OFF, NUM_CTAS, NUM_STAGES, NUM_WARPS,
    ROPE_HALF, SCALE_WORD, _sparse_mla_decode_fp8_cluster_kernel)

# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------

_last_compiled = None    # the compiled kernel of the latest launch (`max_active_clusters`)


def cluster_unsupported(q, kv) -> str | None:
    """Why the cluster kernel cannot run q [N, H, 576] over kv rows, or None: exactly 128 heads (checked first,
    so it is named wherever the tensors are), this module's Gluon, then whatever keeps today's Gluon FP8 kernel
    from running (`hisparse.dsa.fp8.fp8_gluon_unsupported`: an sm_90 GPU, Triton 3.6, bf16 q of 512 + 64, uint8
    [R, 656] rows)."""
    if q.dim() != 3 or q.shape[1] != HEADS:
        heads = q.shape[1] if q.dim() == 3 else f"q shape {tuple(q.shape)}:"
        return f"{heads} heads: it runs exactly {HEADS} (64 a CTA, 2 CTAs a request)"
    return dsa.gluon_platform_unsupported(q, GLUON_IMPORT_ERROR) or fp8.fp8_gluon_unsupported(q, kv)


def sparse_mla_decode_fp8_cluster(q, kv, rows, sm_scale: float, row_base=None, num_splits: int | None = None,
                                  out=None, lse=None):
    """`hisparse.dsa.fp8.sparse_mla_decode_fp8(q, kv, rows, sm_scale, num_splits, out=out, lse=lse,
    row_base=row_base, backend="gluon")` through the 2-CTA cluster kernel: the same arguments, checks, split plan
    (`split_plan` over the Gluon FP8 kernel's tiles), outputs (out [N, 128, 512] bf16, lse [N, 128] float32) and,
    meant bit for bit, values. 128 heads only; ValueError naming why, before any launch, where it cannot run."""
    fp8._check_fp8_decode_inputs(q, kv, rows, sm_scale, out, lse, row_base)
    reason = cluster_unsupported(q, kv)
    dsa._require(reason is None, f"the 2-CTA cluster FP8 decode kernel cannot run this: {reason}")
    n, h, _ = q.shape
    out = out if out is not None else torch.empty((n, h, D_V), dtype=q.dtype, device=q.device)
    lse = lse if lse is not None else torch.empty((n, h), dtype=torch.float32, device=q.device)
    if n == 0:
        return out, lse
    k = rows.shape[1]
    chunk, splits = dsa.split_plan(n, h, k, fp8.GLUON_FP8_TILES, q.device, num_splits)
    part, part_lse, split_strides = dsa.split_buffers(out, lse, splits)
    global _last_compiled
    _last_compiled = _sparse_mla_decode_fp8_cluster_kernel[(1, n, splits)](
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


# ---------------------------------------------------------------------------------------------
# Offline compile (no GPU): TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.gluon_fp8_cluster
# ---------------------------------------------------------------------------------------------

POINTER_TYPES = {"q_ptr": "*bf16", "kv8_ptr": "*fp8e4nv", "kv32_ptr": "*fp32", "kv16_ptr": "*bf16",
                 "rows_ptr": "*i32", "row_base_ptr": "*i64", "out_ptr": "*bf16", "lse_ptr": "*fp32"}
ALIGNED = ("stride_qn", "stride_qh", "stride_rn", "stride_on", "stride_oh")


def compile_offline(row_base: bool):
    """The kernel compiled for sm_90a (Triton 3.6) as a launch specialises it: pointers and the aligned strides
    divisible by 16."""
    from experiments.tools.sass_dsa_gluon import compile_gluon_sm90
    kernel = _sparse_mla_decode_fp8_cluster_kernel
    sig = {name: POINTER_TYPES.get(name) or ("fp32" if name == "qk_scale_log2" else
                                            "constexpr" if name in ("HAS_ROW_BASE", "K_OFF", "BAR_OFF") else "i32")
           for name in kernel.arg_names}
    names = list(sig)
    divisible = [i for i, t in enumerate(sig.values()) if t.startswith("*")] + [names.index(n) for n in ALIGNED]
    constexprs = {"HAS_ROW_BASE": row_base, "K_OFF": K_OFF, "BAR_OFF": BAR_OFF}
    return compile_gluon_sm90(kernel, sig, constexprs, divisible, num_warps=NUM_WARPS, num_ctas=NUM_CTAS)


def allocation_offsets(row_base: bool) -> dict[str, int]:
    """{buffer: allocation.offset} of the kernel's shared buffers, from the MLIR dump of a compile in a subprocess
    (the dump goes to its stderr)."""
    env = dict(os.environ, MLIR_ENABLE_DUMP="1", TRITON_ALWAYS_COMPILE="1", TRITON_INTERPRET="0")
    code = f"from experiments.tools import gluon_fp8_cluster as m; m.compile_offline({row_base})"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the compile for the MLIR dump failed:\n{run.stderr[-3000:]}")
    found = re.findall(r"(%\w+) = ttg\.local_alloc[^{\n]*\{allocation\.offset = (\d+)", run.stderr)
    return {name: int(off) for name, off in found}


def check_offsets(row_base: bool) -> dict[str, int]:
    """The MLIR dump's offsets of %k_nope and %bars against K_OFF and BAR_OFF: SystemExit where they differ (the
    remote stores would land elsewhere and the mbarriers never complete: a hang)."""
    offsets = allocation_offsets(row_base)
    got = {"%k_nope": offsets.get("%k_nope"), "%bars": offsets.get("%bars")}
    if got != {"%k_nope": K_OFF, "%bars": BAR_OFF}:
        raise SystemExit(f"row_base {row_base}: Triton placed K nope at {got['%k_nope']} and the mbarriers at "
                         f"{got['%bars']}, the kernel's asm assumes K_OFF = {K_OFF}, BAR_OFF = {BAR_OFF} (all offsets: "
                         f"{offsets}): set the module constants to the dump's values")
    return offsets


def offline(ptx_dir: str | None = None) -> None:
    import triton

    from experiments.tools.sass import main_loop_ops, registers_and_spills, sass_ops
    from experiments.tools.sass_dsa_gluon import hgmma_shapes, sass_text
    if GLUON_IMPORT_ERROR is not None:
        raise SystemExit(f"Triton {triton.__version__}: no usable Gluon ({GLUON_IMPORT_ERROR})")
    print(f"Triton {triton.__version__}, sm_90a, 2-CTA cluster, {HEADS} heads (64 a CTA), BLOCK_K {BLOCK_K} "
          f"({HALF_K} rows a CTA), {NUM_WARPS} warps, {NUM_STAGES} stages")
    for row_base in (False, True):
        offsets = check_offsets(row_base)
        print(f"  row_base {row_base}: shared offsets {offsets} (K_OFF {K_OFF}, BAR_OFF {BAR_OFF}: as the dump)")
        compiled = compile_offline(row_base)
        if ptx_dir:
            os.makedirs(ptx_dir, exist_ok=True)
            tag = f"fp8_gluon_cluster_rb{int(row_base)}"
            for ext in ("ttgir", "llir", "ptx"):
                with open(os.path.join(ptx_dir, f"{tag}.{ext}"), "w") as f:
                    f.write(compiled.asm[ext])
            with open(os.path.join(ptx_dir, f"{tag}.sass"), "w") as f:
                f.write(sass_text(compiled))
        ptx = compiled.asm["ptx"]
        for directive in (".explicitcluster", ".reqnctapercluster 2"):
            if directive not in ptx:
                raise SystemExit(f"no {directive} in the PTX: not compiled as a cluster kernel")
        regs, spills = registers_and_spills(compiled)
        ops = sass_ops(compiled)
        sass = sass_text(compiled)
        sync = collections.Counter(re.findall(r"\b(STAS\.\d+|UCGABAR_\w+|MEMBAR\.\w+\.\w+|FENCE\.\w+\.\w+\.?\w*|"
                                              r"SYNCS\.[\w.]+|BAR\.SYNC\w*|MAPA\w*)", sass))
        print(f"    {regs} regs, {spills} B spilled, {compiled.metadata.shared // 1024} KiB shared "
              f"({compiled.metadata.shared} B), num_ctas {compiled.metadata.num_ctas}")
        print(f"    remote stores (STAS.128) {sync.get('STAS.128', 0)}, local STS {ops['STS']}, cluster barriers "
              f"UCGABAR_ARV {sync.get('UCGABAR_ARV', 0)} / UCGABAR_WAIT {sync.get('UCGABAR_WAIT', 0)}, "
              f"MEMBAR.ALL.GPU {sync.get('MEMBAR.ALL.GPU', 0)}")
        print(f"    sync ops: {dict(sorted(sync.items()))}")
        print(f"    main loop: {main_loop_ops(sass)[0]} instructions (one trip)")
        print(f"    HGMMA shapes: {hgmma_shapes(compiled)}")


# ---------------------------------------------------------------------------------------------
# GPU timing (--time): the cluster kernel against today's Gluon FP8 kernel, graphed
# ---------------------------------------------------------------------------------------------

def max_active_clusters() -> int:
    """How many of the latest launch's clusters (2 CTAs, its shared memory) the GPU holds at once
    (cuOccupancyMaxActiveClusters): below the grid's cluster count, the launch runs in more than one wave."""
    import triton
    kernel = _last_compiled
    kernel._init_handles()
    return triton.runtime.driver.active.utils.cuOccupancyMaxActiveClusters(kernel.function, kernel.metadata.shared,
                                                                          NUM_CTAS)


def time_against_gluon(batches=(64, 128), k: int = 2048, context: int = 8192, seed: int = 0) -> None:
    """At 128 heads, k rows over a pool of batch * context FP8 rows (bench_attention_dsa's make_inputs): us
    (CUDA graphs, benchmarks/common.py's time_us) and roofline fraction over 656-byte rows of today's Gluon FP8
    kernel and of the cluster kernel, and whether their outputs are bitwise equal."""
    from benchmarks.bench_attention_dsa import SM_SCALE, make_inputs, work
    from benchmarks.common import HBM_BYTES_PER_S, MMA_FLOPS_PER_S, time_us
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for batch in batches:
        q, kv, rows = make_inputs(batch, context, HEADS, k, torch.device("cuda"), gen)
        stored = fp8.to_rows(kv)
        del kv
        reason = cluster_unsupported(q, stored)
        if reason is not None:
            raise SystemExit(f"the cluster kernel cannot run here: {reason}")
        flops, nbytes = work(batch, HEADS, k, fp8.ROW_BYTES)
        roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
        ref = fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="gluon")
        got = sparse_mla_decode_fp8_cluster(q, stored, rows, SM_SCALE)
        same = torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        splits = dsa.split_plan(batch, HEADS, k, fp8.GLUON_FP8_TILES, q.device)[1]
        print(f"batch {batch:4d}: {batch * splits} clusters of 2 CTAs, at most {max_active_clusters()} resident at "
              "once", flush=True)
        kernels = {"gluon_fp8": lambda: fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="gluon")[0],
                   "gluon_fp8_cluster": lambda: sparse_mla_decode_fp8_cluster(q, stored, rows, SM_SCALE)[0]}
        base = None
        for name, fn in kernels.items():
            us, p20, p80 = time_us(fn, cudagraph=True)
            base = base or us
            print(f"batch {batch:4d} heads {HEADS} k {k} context {context}: {name:18s} {us:8.1f} us "
                  f"(p20 {p20:.1f}, p80 {p80:.1f})  roofline_frac {roofline_us / us:.3f}  "
                  f"x{base / us:.3f} of gluon_fp8", flush=True)
        print(f"batch {batch:4d}: cluster bitwise equal to gluon_fp8: {same}", flush=True)
        del q, stored, rows, ref, got
        torch.cuda.empty_cache()


def smoke(n: int = 3, k: int = 333, seed: int = 0) -> bool:
    """On a Hopper GPU, before anything else: the shared offsets as this machine's Triton places them (a mismatch
    would hang the kernel), then one small launch (n requests, k rows: a short last tile, -1 rows, a request
    without any) against today's Gluon FP8 kernel. Prints and returns whether out and lse are bitwise equal. Run
    it in a process with a time limit: a wrong barrier hangs the GPU until the process is killed."""
    for row_base in (False, True):
        check_offsets(row_base)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    latent = torch.randn(n * 4096, 512, device="cuda", generator=gen).bfloat16()
    rope = torch.randn(n * 4096, 64, device="cuda", generator=gen).bfloat16()
    kv = fp8.quantize_rows(latent, rope)
    q = (torch.randn(n, HEADS, 576, device="cuda", generator=gen) * 0.3).bfloat16()
    rows = torch.stack([torch.randperm(4096, device="cuda", generator=gen)[:k] + i * 4096 for i in range(n)])
    rows = rows.to(torch.int32)
    rows[torch.rand(n, k, device="cuda", generator=gen) < 0.1] = -1
    rows[-1] = -1
    ok = True
    for splits in (1, 3):
        ref = fp8.sparse_mla_decode_fp8(q, kv, rows, 0.1, num_splits=splits, backend="gluon")
        got = sparse_mla_decode_fp8_cluster(q, kv, rows, 0.1, num_splits=splits)
        torch.cuda.synchronize()
        same = torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        diff = (ref[0].float() - got[0].float()).abs().nan_to_num(float("inf")).max().item()
        print(f"smoke n {n} k {k} splits {splits}: bitwise equal {same} (max |out diff| {diff:.3g})", flush=True)
        ok = ok and same
    return ok


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="on a Hopper GPU: time against today's Gluon FP8 kernel")
    ap.add_argument("--smoke", action="store_true", help="on a Hopper GPU: offsets, then one small launch against "
                    "today's Gluon FP8 kernel (exit status 1 unless bitwise equal)")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--context", type=int, default=8192, help="pool rows per request for --time (default %(default)s)")
    ap.add_argument("--ptx", metavar="DIR", help="offline: also write the ttgir/llir/ptx/sass there")
    args = ap.parse_args(argv)
    if args.smoke:
        sys.exit(0 if smoke() else 1)
    if args.time:
        time_against_gluon(tuple(args.batches), context=args.context)
    else:
        offline(args.ptx)


if __name__ == "__main__":
    main()
