"""Compile the Gluon sparse MLA decode kernel (kernels_triton/dsa_gluon.py) for sm_90a without a GPU
and report it next to the Triton kernel (experiments/tools/sass_dsa.py's report): registers, spills, shared
memory, and SASS counts, with the wgmma (HGMMA) instructions broken down by shape, since QK^T
(64xNx16 with N = BLOCK_K or BLOCK_K / 2) and PV (64x256x16 or 64x512...) are told apart by it.

    TRITON_INTERPRET=0 /tmp/t36b/bin/python -m experiments.tools.sass_dsa_gluon [--ptx] [--block-k 64]
    TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.sass_dsa_gluon --prefill [--ptx DIR]

--prefill reports the warp-specialised prefill kernel (kernels_triton/dsa_gluon_prefill.py) instead, with
and without row_base and in its tuning variants: the same counts, and each partition's registers
(setmaxnreg), instructions, local-memory accesses and barriers (BAR.SYNC: named barriers over the partition,
the ones `gl.thread_barrier` and Triton's shared-memory analysis put there).

Needs a Triton with Gluon's Hopper API (3.6). A Gluon kernel compiles through GluonASTSource (not
experiments/tools/sass.py's ASTSource, which would parse it as a Triton kernel); the rest reuses
experiments/tools/sass.py.
Counts are static (instructions in the program, not executed).
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

import kernels_triton.dsa_gluon as dg
from experiments.tools import sass_dsa
from experiments.tools.sass import TOOLS, compile_sm90, main_loop_ops, registers_and_spills, sass_ops

D_V, D_ROPE = sass_dsa.D_V, sass_dsa.D_ROPE
SHOWN = sass_dsa.SHOWN


def compile_gluon_sm90(kernel, signature: dict, constexprs: dict, divisible: list[int], **options):
    """As experiments/tools/sass.py's compile_sm90, for a `gluon.jit` kernel."""
    from triton.experimental.gluon._runtime import GluonASTSource
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = GluonASTSource(fn=kernel, signature=signature, attrs=attrs, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_text(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout


def hgmma_shapes(compiled) -> str:
    """'64x32x16 x36, 64x256x16 x4': the wgmma instructions by shape (static count)."""
    shapes = collections.Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass_text(compiled)))
    return ", ".join(f"{s} x{c}" for s, c in sorted(shapes.items(), key=lambda kv: -kv[1])) or "none"


def gluon_signature():
    kernel = dg._sparse_mla_decode_gluon_kernel
    sig = {name: sass_dsa.POINTER_TYPES.get(name) or ("fp32" if name == "qk_scale_log2" else
                                                     "constexpr" if (name.isupper() or name == "num_warps")
                                                     and name not in ("H", "K_SEL", "CHUNK") else "i32")
           for name in kernel.arg_names}
    return kernel, sig


def compile_gluon(block_k: int, stages: int, row_base: bool):
    kernel, sig = gluon_signature()
    names = list(sig)
    divisible = [i for i, t in enumerate(sig.values()) if t.startswith("*")] + \
        [names.index(n) for n in sass_dsa.ALIGNED]
    constexprs = {"D_V": D_V, "D_ROPE": D_ROPE, "BLOCK_H": dg.BLOCK_H, "BLOCK_K": block_k,
                  "HAS_ROW_BASE": row_base, "NUM_STAGES": stages, "num_warps": dg.NUM_WARPS}
    return compile_gluon_sm90(kernel, sig, constexprs, divisible, num_warps=dg.NUM_WARPS)


def gluon_report(block_k: int, stages: int, row_base: bool, ptx_dir: str | None = None) -> str:
    try:
        compiled = compile_gluon(block_k, stages, row_base)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return "does not compile: " + " / ".join(lines[-6:])[:1500]
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
        tag = f"gluon_bk{block_k}_st{stages}_rb{int(row_base)}"
        for ext in ("ttgir", "llir", "ptx"):
            with open(os.path.join(ptx_dir, f"{tag}.{ext}"), "w") as f:
                f.write(compiled.asm[ext])
        with open(os.path.join(ptx_dir, f"{tag}.sass"), "w") as f:
            f.write(sass_text(compiled))
    regs, spills = registers_and_spills(compiled)
    ops = sass_ops(compiled)
    counts = " ".join(f"{name} {ops[name]}" for name in SHOWN)
    return (f"{regs} regs, {spills} B spilled, {compiled.metadata.shared // 1024} KiB shared "
            f"({compiled.metadata.shared} B) | {counts} | main loop {main_loop_ops(sass_text(compiled))[0]} "
            f"instructions | HGMMA shapes: {hgmma_shapes(compiled)}")


def triton_hgmma_shapes(block_k: int, row_base: bool) -> str:
    names = list(sass_dsa.SIGNATURE)
    divisible = [i for i, t in enumerate(sass_dsa.SIGNATURE.values()) if t.startswith("*")] + \
        [names.index(n) for n in sass_dsa.ALIGNED]
    constexprs = {"D_V": D_V, "D_ROPE": D_ROPE, "BLOCK_H": 64, "BLOCK_K": block_k, "DOT_PRECISION": "ieee",
                  "HAS_ROW_BASE": row_base}
    try:
        compiled = compile_sm90(sass_dsa.KERNEL, sass_dsa.SIGNATURE, constexprs, divisible, num_warps=8,
                                num_stages=2)
    except Exception as exc:  # noqa: BLE001
        return f"does not compile: {str(exc).splitlines()[-1][:150]}"
    return hgmma_shapes(compiled)


PREFILL_VARIANTS = {  # name -> the prefill kernel's tuning constexprs (its launcher's keywords)
    "default": {},
    "no consumer fence": {"FENCE": False},
    "WG1 200 / producer 72 registers": {"CONSUMER_REGS": 200, "PRODUCER_REGS": 72},
    "WG1 216 / producer 56 registers": {"CONSUMER_REGS": 216, "PRODUCER_REGS": 56},
}


def compile_prefill(row_base: bool, **tuning):
    """The Gluon prefill kernel compiled for sm_90a as `launch_gluon_prefill` specialises it: pointers, the
    aligned strides and the split strides (0 for its one split) divisible by 16."""
    import kernels_triton.dsa_gluon_prefill as pg
    kernel = pg._sparse_mla_prefill_gluon_kernel
    sig = {name: sass_dsa.POINTER_TYPES.get(name) or ("fp32" if name == "qk_scale_log2" else
                                                     "constexpr" if (name.isupper() or name == "num_warps")
                                                     and name not in ("H", "K_SEL", "CHUNK") else "i32")
           for name in kernel.arg_names}
    names = list(sig)
    divisible = [i for i, t in enumerate(sig.values()) if t.startswith("*")] + \
        [names.index(n) for n in sass_dsa.ALIGNED + ("stride_os", "stride_ls")]
    constexprs = {"D_V": D_V, "D_ROPE": D_ROPE, "BLOCK_H": pg.BLOCK_H, "BLOCK_K": pg.BLOCK_K,
                  "HAS_ROW_BASE": row_base, "NUM_STAGES": pg.NUM_STAGES, "num_warps": pg.NUM_WARPS,
                  "FENCE": True, "CONSUMER_REGS": pg.CONSUMER_REGS, "PRODUCER_REGS": pg.PRODUCER_REGS}
    constexprs.update(tuning)
    return compile_gluon_sm90(kernel, sig, constexprs, divisible, num_warps=pg.NUM_WARPS), constexprs


def prefill_partitions(sass: str, consumer_regs: int, producer_regs: int) -> dict[str, tuple[int, int, int, int]]:
    """{partition: (registers, instructions, local loads/stores, BAR.SYNC)} of the prefill kernel's SASS, each
    partition's code from the setmaxnreg that enters it to the next: WG1 the first raise to consumer_regs, the
    producer the first drop to producer_regs, WG0 the default warps' drop from their prologue's count to what
    Triton left them (the first drop to neither the idle count nor the producer's)."""
    lines = sass.splitlines()
    marks = [(i, kind, int(regs, 16)) for i, line in enumerate(lines)
             for kind, regs in re.findall(r"USETMAXREG\.(\w+)\.CTAPOOL[^,;]*,? ?(0x[0-9a-f]+)", line)]
    if not marks:
        raise ValueError("no setmaxnreg in the SASS: Triton gave the partitions no registers of their own")
    idle = marks[0][2]

    def span(pick):
        k = next(k for k, (_, kind, regs) in enumerate(marks) if pick(kind, regs))
        return marks[k][2], lines[marks[k][0]:marks[k + 1][0] if k + 1 < len(marks) else len(lines)]

    found = {}
    for name, pick in (("WG0", lambda kind, regs: kind == "DEALLOC" and regs not in (idle, producer_regs)),
                       ("WG1", lambda kind, regs: kind == "TRY_ALLOC" and regs == consumer_regs),
                       ("producer", lambda kind, regs: kind == "DEALLOC" and regs == producer_regs)):
        regs, part = span(pick)
        body = [line for line in part if re.search(r"/\*[0-9a-f]{4,6}\*/", line)]
        local = sum(bool(re.search(r"\b(STL|LDL)\b", line)) for line in body)
        bars = sum("BAR.SYNC" in line for line in body)
        found[name] = (regs, len(body), local, bars)
    return found


def prefill_report(row_base: bool, ptx_dir: str | None = None, **tuning) -> str:
    try:
        compiled, constexprs = compile_prefill(row_base, **tuning)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return "does not compile: " + " / ".join(lines[-8:])[:2500]
    sass = sass_text(compiled)
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
        tag = f"prefill_rb{int(row_base)}" + "".join(f"_{k}{v}" for k, v in sorted(tuning.items()))
        for ext in ("ttgir", "llir", "ptx"):
            with open(os.path.join(ptx_dir, f"{tag}.{ext}"), "w") as f:
                f.write(compiled.asm[ext])
        with open(os.path.join(ptx_dir, f"{tag}.sass"), "w") as f:
            f.write(sass)
    regs, spills = registers_and_spills(compiled)
    ops = sass_ops(compiled)
    counts = " ".join(f"{name} {ops[name]}" for name in SHOWN)
    try:
        parts = ", ".join(f"{name} {r} registers, {n} instructions, {local} local loads/stores, {bars} BAR.SYNC"
                          for name, (r, n, local, bars) in prefill_partitions(
                              sass, constexprs["CONSUMER_REGS"], constexprs["PRODUCER_REGS"]).items())
    except (ValueError, StopIteration) as exc:
        parts = f"partitions not found ({exc})"
    return (f"launch {regs} regs, {spills} B spilled, {compiled.metadata.shared // 1024} KiB shared "
            f"({compiled.metadata.shared} B of 232448) | {counts} | {parts} | HGMMA shapes: {hgmma_shapes(compiled)}")


def prefill_main(args) -> None:
    import kernels_triton.dsa_gluon_prefill as pg
    if pg.GLUON_IMPORT_ERROR is not None:
        raise SystemExit(f"Triton {triton.__version__}: no usable Gluon ({pg.GLUON_IMPORT_ERROR})")
    print(f"Triton {triton.__version__}, sm_90a, D {D_V} + {D_ROPE}, bf16, prefill kernel: BLOCK_H {pg.BLOCK_H}, "
          f"BLOCK_K {pg.BLOCK_K}, WG0 + WG1 + producer (4 warps each), {pg.NUM_STAGES} K buffers")
    for row_base in (False, True):
        print(f"  default, row_base {'on ' if row_base else 'off'}: {prefill_report(row_base, args.ptx)}")
    for name, tuning in PREFILL_VARIANTS.items():
        if tuning:
            print(f"  {name}, row_base off: {prefill_report(False, args.ptx, **tuning)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-k", type=int, default=dg.BLOCK_K, help="rows per tile (default %(default)s)")
    ap.add_argument("--stages", type=int, default=dg.NUM_STAGES, help="Gluon ring of tiles (default %(default)s)")
    ap.add_argument("--extra", action="store_true", help="also the Gluon kernel at BLOCK_K 32 with 3 and 4 stages")
    ap.add_argument("--ptx", metavar="DIR", help="also write the Gluon kernel's ttgir/llir/ptx/sass there")
    ap.add_argument("--prefill", action="store_true",
                    help="report the prefill kernel (kernels_triton/dsa_gluon_prefill.py) and its variants instead")
    args = ap.parse_args(argv)
    if args.prefill:
        prefill_main(args)
        return
    if dg.GLUON_IMPORT_ERROR is not None:
        raise SystemExit(f"Triton {triton.__version__}: no usable Gluon ({dg.GLUON_IMPORT_ERROR})")
    print(f"Triton {triton.__version__}, sm_90a, {sass_dsa.HEADS} heads, D {D_V} + {D_ROPE}, bf16, "
          f"BLOCK_H 64, BLOCK_K {args.block_k}, 8 warps; Gluon {args.stages} stages, Triton 2 stages")
    for row_base in (False, True):
        tag = "on " if row_base else "off"
        print(f"  gluon  row_base {tag}: {gluon_report(args.block_k, args.stages, row_base, args.ptx)}")
        print(f"  triton row_base {tag}: {sass_dsa.report(64, args.block_k, 8, 2, row_base)} | HGMMA shapes: "
              f"{triton_hgmma_shapes(args.block_k, row_base)}")
    if args.extra:
        for block_k, stages in ((32, 3), (32, 4)):
            print(f"  gluon  BLOCK_K {block_k}, {stages} stages, row_base off: "
                  f"{gluon_report(block_k, stages, False, args.ptx)}")


if __name__ == "__main__":
    main()
