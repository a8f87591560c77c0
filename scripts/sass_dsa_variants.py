"""SASS numbers of the DSA decode variants (kernels_triton/dsa_variants.py) beside the default kernel,
compiled for sm_90a without a GPU: registers, spills, shared memory, HGMMA/LDGSTS/LDG counts and the
CTAs per SM those allow (H200: 64K registers, 228 KiB shared memory per SM, 227 KiB per CTA).

    python -m scripts.sass_dsa_variants          # or /tmp/t36b/bin/python -m scripts.sass_dsa_variants
"""
import triton

from kernels_triton.dsa import _sparse_mla_decode_kernel
from kernels_triton.dsa_variants import _mla_fused_kernel
from scripts.sass import compile_sm90, registers_and_spills, sass_ops

D_V, D_ROPE = 512, 64
POINTER_TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "rows_ptr": "*i32", "row_base_ptr": "*i64",
                 "out_ptr": "*bf16", "lse_ptr": "*fp32"}
ALIGNED = ("stride_qn", "stride_qh", "stride_kv", "stride_rn", "stride_on", "stride_oh")
SHOWN = ("HGMMA", "LDGSTS", "LDG", "STS", "LDS", "STL", "LDL", "BAR")

# (name, kernel, constexprs beyond D_V/D_ROPE/DOT_PRECISION/HAS_ROW_BASE, num_warps, num_stages)
CANDIDATES = [
    ("default", _sparse_mla_decode_kernel, dict(BLOCK_H=64, BLOCK_K=32), 8, 2),
] + [
    (f"fused h{bh} k{bk} v{vs} w{w} s{st}", _mla_fused_kernel, dict(BLOCK_H=bh, BLOCK_K=bk, V_SPLIT=vs), w, st)
    for bh, bk, vs, w, st in [
        (64, 16, 2, 4, 2), (64, 16, 2, 4, 3), (64, 32, 2, 4, 2), (64, 32, 2, 4, 3), (64, 64, 2, 4, 2),
        (64, 32, 2, 8, 2), (64, 64, 2, 8, 2), (128, 16, 2, 8, 2), (128, 16, 2, 8, 3), (128, 32, 2, 8, 2),
        (64, 32, 1, 8, 2), (64, 32, 1, 8, 3), (64, 16, 1, 8, 3), (64, 64, 1, 8, 2),
        (32, 16, 1, 4, 2), (32, 16, 1, 4, 3), (32, 32, 1, 4, 2), (32, 32, 1, 4, 3), (16, 32, 1, 4, 3),
    ]
]


def signature(kernel) -> dict:
    return {name: POINTER_TYPES.get(name) or ("fp32" if name == "qk_scale_log2" else
                                              "constexpr" if name.isupper() and name not in ("H", "K_SEL", "CHUNK")
                                              else "i32")
            for name in kernel.arg_names}


def report(kernel, constexprs: dict, warps: int, stages: int) -> str:
    sig = signature(kernel)
    names = list(sig)
    divisible = [i for i, t in enumerate(sig.values()) if t.startswith("*")] + [names.index(n) for n in ALIGNED]
    constexprs = dict(D_V=D_V, D_ROPE=D_ROPE, DOT_PRECISION="ieee", HAS_ROW_BASE=True, **constexprs)
    try:
        compiled = compile_sm90(kernel, sig, constexprs, divisible, num_warps=warps, num_stages=stages)
    except Exception as exc:  # noqa: BLE001 - a config that cannot be built is reported, not fatal
        return f"does not compile: {str(exc).splitlines()[-1][:150]}"
    regs, spills = registers_and_spills(compiled)
    shared = compiled.metadata.shared
    ctas = min(65536 // (max(regs, 1) * 32 * warps // 8 * 8) if regs > 0 else 0,
               (228 * 1024) // max(shared + 1024, 1) if shared <= 227 * 1024 else 0)
    ops = sass_ops(compiled)
    counts = " ".join(f"{name} {ops[name]}" for name in SHOWN)
    return f"{regs:3d} regs {spills:4d} B spill {shared // 1024:3d} KiB smem -> {ctas} CTA/SM | {counts}"


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90a, D {D_V} + {D_ROPE}, bf16, row_base on")
    for name, kernel, constexprs, warps, stages in CANDIDATES:
        print(f"  {name:26s} {report(kernel, constexprs, warps, stages)}")


if __name__ == "__main__":
    main()
