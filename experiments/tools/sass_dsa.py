"""Compile the DSA sparse MLA decode kernel for sm_90 without a GPU and report what it holds and does
(no device time): registers, spills and shared memory per program, and the SASS counts that tell a
Hopper kernel's shape (wgmma `HGMMA`, asynchronous copies `LDGSTS`, plain loads and stores, barriers).

    TRITON_INTERPRET=0 python -m experiments.tools.sass_dsa [--block-h 64] [--block-k 64] [--warps 8] [--stages 2]

Without options: the default bf16 config at DeepSeek's sizes (kernels_triton/dsa.py), with and
without `row_base`. Pointers and row strides are taken 16-byte aligned, as a launch on contiguous
tensors specialises them. Compiled and read by experiments/tools/sass.py.
"""
import argparse

import triton

from experiments.tools.sass import compile_sm90, registers_and_spills, sass_ops
from hisparse.dsa.ops import default_decode_config
from kernels_triton.dsa import _sparse_mla_decode_kernel as KERNEL

D_V, D_ROPE, HEADS = 512, 64, 128
POINTER_TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "rows_ptr": "*i32", "row_base_ptr": "*i64",
                 "out_ptr": "*bf16", "lse_ptr": "*fp32"}
ALIGNED = ("stride_qn", "stride_qh", "stride_kv", "stride_rn", "stride_on", "stride_oh")
SIGNATURE = {name: POINTER_TYPES.get(name) or ("fp32" if name == "qk_scale_log2" else
                                              "constexpr" if name.isupper() and name not in ("H", "K_SEL", "CHUNK")
                                              else "i32")
             for name in KERNEL.arg_names}
SHOWN = ("HGMMA", "LDGSTS", "LDG", "STG", "STS", "LDS", "STL", "LDL", "BAR", "MUFU")   # STL/LDL: spills


def report(block_h: int, block_k: int, warps: int, stages: int, row_base: bool) -> str:
    names = list(SIGNATURE)
    divisible = [i for i, t in enumerate(SIGNATURE.values()) if t.startswith("*")] + [names.index(n) for n in ALIGNED]
    constexprs = {"D_V": D_V, "D_ROPE": D_ROPE, "BLOCK_H": block_h, "BLOCK_K": block_k, "DOT_PRECISION": "ieee",
                  "HAS_ROW_BASE": row_base}
    try:
        compiled = compile_sm90(KERNEL, SIGNATURE, constexprs, divisible, num_warps=warps, num_stages=stages)
    except Exception as exc:  # noqa: BLE001 - a config that cannot be built is reported, not fatal
        return f"does not compile: {str(exc).splitlines()[-1][:150]}"
    regs, spills = registers_and_spills(compiled)
    ops = sass_ops(compiled)
    counts = " ".join(f"{name} {ops[name]}" for name in SHOWN)
    return f"{regs} regs, {spills} B spilled, {compiled.metadata.shared // 1024} KiB shared | {counts}"


def main(argv=None) -> None:
    default = default_decode_config(HEADS, D_V + D_ROPE, __import__("torch").bfloat16)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-h", type=int, default=default.block_h, help="heads per program (default %(default)s)")
    ap.add_argument("--block-k", type=int, default=default.block_k, help="rows per step (default %(default)s)")
    ap.add_argument("--warps", type=int, default=default.num_warps, help="num_warps (default %(default)s)")
    ap.add_argument("--stages", type=int, default=default.num_stages, help="num_stages (default %(default)s)")
    args = ap.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90a, {HEADS} heads, D {D_V} + {D_ROPE}, bf16: "
          f"BLOCK_H {args.block_h}, BLOCK_K {args.block_k}, {args.warps} warps, {args.stages} stages")
    for row_base in (False, True):
        print(f"  row_base {'on ' if row_base else 'off'}: "
              f"{report(args.block_h, args.block_k, args.warps, args.stages, row_base)}")


if __name__ == "__main__":
    main()
