"""Compile the FP8 indexer's rotate-and-quantise kernel (kernels_triton/dsa_index_quant.py) for sm_90 without
a GPU and report what it holds and does (no device time): registers, spills and shared memory per program,
and the SASS counts that tell whether a row's butterflies stay in its thread (no shuffles `SHFL`, shared
memory `STS`/`LDS` only for the load's and the stores' layout changes).

    TRITON_INTERPRET=0 python -m experiments.tools.sass_index_quant [--warps 4]

Each head dim and input dtype the launcher takes at the default warps; pointers and the row stride taken
16-byte aligned and the element stride 1, as a launch on contiguous tensors specialises them. Compiled and
read by experiments/tools/sass.py.
"""
import argparse

import triton

from experiments.tools.sass import compile_sm90, registers_and_spills, sass_ops
from kernels_triton.dsa_index_quant import NUM_WARPS, rotate_scale
from kernels_triton.dsa_index_quant import _rotate_quantize_kernel as KERNEL

SHOWN = ("SHFL", "STS", "LDS", "BAR", "FADD", "LDG", "STG", "STL", "LDL")   # STL/LDL: spills
POINTERS = {"w_ptr": "*fp32", "values_ptr": "*fp8e4nv", "scales_ptr": "*fp32"}
CONSTANT = ("stride_xd", "stride_w", "D", "LOG2_D", "ROTATE_SCALE", "BLOCK_R", "HAS_W")


def report(d: int, dtype: str, warps: int, weights: bool) -> str:
    signature = {name: "constexpr" if name in CONSTANT else POINTERS.get(name, "i32") for name in KERNEL.arg_names}
    signature["x_ptr"] = dtype
    names = list(signature)
    divisible = [names.index(n) for n in ("x_ptr", "w_ptr", "values_ptr", "scales_ptr", "stride_xr")]
    constexprs = {"stride_xd": 1, "stride_w": 1, "D": d, "LOG2_D": d.bit_length() - 1, "ROTATE_SCALE": rotate_scale(d),
                  "BLOCK_R": 32 * warps, "HAS_W": weights}
    compiled = compile_sm90(KERNEL, signature, constexprs, divisible, num_warps=warps)
    regs, spilled = registers_and_spills(compiled)
    ops = sass_ops(compiled)
    total = sum(n for name, n in ops.items() if name != "vec16B")
    counts = " ".join(f"{name} {ops[name]}" for name in SHOWN)
    return (f"{regs} regs, {spilled} B spilled, {compiled.metadata.shared} B shared, {total} instructions "
            f"({total / d:.1f} a value) | {counts}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warps", type=int, default=NUM_WARPS, help="num_warps, 32 rows each (default %(default)s)")
    args = ap.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90a, {args.warps} warps, {32 * args.warps} rows a program (one a thread)")
    for d in (16, 32, 64, 128, 256):
        for dtype in ("*bf16", "*fp32"):
            print(f"  D {d:3d} {dtype[1:]:4s} with weights: {report(d, dtype, args.warps, True)}")
    print(f"  D 128 bf16  no weights:   {report(128, '*bf16', args.warps, False)}")


if __name__ == "__main__":
    main()
