"""Compile the Gluon sparse MLA decode kernel over FP8 rows (kernels_triton/dsa_fp8_gluon.py) for sm_90a
without a GPU and report it beside the bf16 rows' Gluon kernel (experiments/tools/sass_dsa_gluon.py's
report): registers, spills, shared memory, SASS counts, each warp partition's registers (setmaxnreg),
instructions and local-memory accesses, and the wgmma (HGMMA) shapes;
F2FP / F2F / HADD2 / FMUL / PRMT count the dequantisation's conversions and multiplies.

    TRITON_INTERPRET=0 /tmp/t36/bin/python -m experiments.tools.sass_dsa_fp8_gluon [--ptx DIR]

Needs Triton 3.6 (its Gluon Hopper API). Counts are static (instructions in the program, not executed).
"""
import argparse
import os
import re

import triton

import kernels_triton.dsa_fp8_gluon as fg
from experiments.tools import sass_dsa, sass_dsa_gluon
from experiments.tools.sass import registers_and_spills, sass_ops

POINTER_TYPES = {"q_ptr": "*bf16", "kv8_ptr": "*fp8e4nv", "kv32_ptr": "*fp32", "kv16_ptr": "*bf16",
                 "rows_ptr": "*i32", "row_base_ptr": "*i64", "out_ptr": "*bf16", "lse_ptr": "*fp32"}
ALIGNED = ("stride_qn", "stride_qh", "stride_rn", "stride_on", "stride_oh")
CONVERSIONS = ("F2FP", "F2F", "HADD2", "FMUL", "PRMT")


def fp8_signature() -> dict:
    """Argument name -> type of the Gluon FP8 kernel as a launch sees it."""
    kernel = fg._sparse_mla_decode_fp8_gluon_kernel
    return {name: POINTER_TYPES.get(name) or ("fp32" if name == "qk_scale_log2" else
                                             "constexpr" if (name.isupper() or name == "num_warps")
                                             and name not in ("H", "K_SEL", "CHUNK", "STRIDE16") else "i32")
            for name in kernel.arg_names}


def compile_fp8_gluon(row_base: bool):
    """The Gluon FP8 kernel compiled for sm_90a as `_launch_gluon` specialises it: pointers and the aligned
    strides divisible by 16."""
    sig = fp8_signature()
    names = list(sig)
    divisible = [i for i, t in enumerate(sig.values()) if t.startswith("*")] + [names.index(n) for n in ALIGNED]
    constexprs = {"BLOCK_H": fg.BLOCK_H, "BLOCK_K": fg.BLOCK_K, "HAS_ROW_BASE": row_base,
                  "NUM_STAGES": fg.NUM_STAGES, "num_warps": fg.NUM_WARPS}
    return sass_dsa_gluon.compile_gluon_sm90(fg._sparse_mla_decode_fp8_gluon_kernel, sig, constexprs, divisible,
                                             num_warps=fg.NUM_WARPS)


def partitions(sass: str) -> dict[str, tuple[int, int, int]]:
    """{partition: (registers it runs at, instructions, local loads and stores)} of the warp-specialised
    kernel's SASS: the producer's code runs between its setmaxnreg up and its drop back to the idle count, the
    consumers' between their drop for the region and their return."""
    lines = sass.splitlines()
    marks = [(i, kind, int(regs, 16)) for i, line in enumerate(lines)
             for kind, regs in re.findall(r"USETMAXREG\.(\w+)\.CTAPOOL[^,;]*,? ?(0x[0-9a-f]+)", line)]
    if len(marks) != 6:
        raise ValueError(f"expected 6 setmaxnreg (idle, producer in and out, consumers' parent, region, return), "
                         f"got {[(k, r) for _, k, r in marks]}")
    spans = {"producer": (marks[1], marks[2]), "consumers": (marks[4], marks[5])}
    found = {}
    for name, ((start, _, regs), (stop, _, _)) in spans.items():
        body = [line for line in lines[start:stop] if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        local = sum(bool(re.search(r"\b(STL|LDL)\b", line)) for line in body)
        found[name] = (regs, len(body), local)
    return found


def fp8_report(row_base: bool, ptx_dir: str | None = None) -> str:
    try:
        compiled = compile_fp8_gluon(row_base)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return "does not compile: " + " / ".join(lines[-8:])[:2500]
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
        tag = f"fp8_gluon_rb{int(row_base)}"
        for ext in ("ttgir", "llir", "ptx"):
            with open(os.path.join(ptx_dir, f"{tag}.{ext}"), "w") as f:
                f.write(compiled.asm[ext])
        with open(os.path.join(ptx_dir, f"{tag}.sass"), "w") as f:
            f.write(sass_dsa_gluon.sass_text(compiled))
    regs, spills = registers_and_spills(compiled)
    ops = sass_ops(compiled)
    counts = " ".join(f"{name} {ops[name]}" for name in sass_dsa.SHOWN + CONVERSIONS)
    parts = ", ".join(f"{name} at {r} registers, {n} instructions, {local} local loads/stores"
                      for name, (r, n, local) in partitions(sass_dsa_gluon.sass_text(compiled)).items())
    return (f"{regs} regs, {spills} B spilled, {compiled.metadata.shared // 1024} KiB shared "
            f"({compiled.metadata.shared} B) | {counts} | {parts} | "
            f"HGMMA shapes: {sass_dsa_gluon.hgmma_shapes(compiled)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptx", metavar="DIR", help="also write the FP8 kernel's ttgir/llir/ptx/sass there")
    args = ap.parse_args(argv)
    if fg.GLUON_IMPORT_ERROR is not None:
        raise SystemExit(f"Triton {triton.__version__}: no usable Gluon ({fg.GLUON_IMPORT_ERROR})")
    print(f"Triton {triton.__version__}, sm_90a, D {fg.D_V} + {fg.D_ROPE}, bf16 q, BLOCK_H {fg.BLOCK_H}, "
          f"BLOCK_K {fg.BLOCK_K}, {fg.NUM_WARPS} consumer warps + {fg.PRODUCER_WARPS} producer warps, "
          f"{fg.NUM_STAGES} K buffers")
    for row_base in (False, True):
        tag = "on " if row_base else "off"
        print(f"  gluon fp8 row_base {tag}: {fp8_report(row_base, args.ptx)}")
        print(f"  gluon bf16 row_base {tag}: {sass_dsa_gluon.gluon_report(64, 2, row_base)}")


if __name__ == "__main__":
    main()
