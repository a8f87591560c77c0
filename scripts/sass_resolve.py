"""Compile the resolve kernel for sm_90 without a GPU and count what its SASS does (no device time).

    python -m scripts.sass_resolve [--warps 8] [--k 2048] [--cache-slots 4096]

Both variants of kernels_triton/resolve.py are compiled as a launch at these sizes would specialise
them: every pointer 16-byte aligned, and K and B divisible by 16 for `_resolve_kernel` (Triton's
default for such integers) but not for `_resolve_kernel_flat` (do_not_specialize). Printed per
variant: SASS instructions in all, global loads and stores (and how many are 16-byte vectors), block
barriers, shared-memory traffic, warp shuffles, and the layout conversions in the Triton GPU IR.
Uses the cuobjdump that ships with Triton's NVIDIA backend. The counts are static (instructions in
the program, not executed); the Triton version here may differ from the GPU machine's.
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels_triton.resolve import _resolve_kernel, _resolve_kernel_flat

SIZES_ARGS = ("K", "B")
SIGNATURE = {name: ("*i64" if name in ("host_base_ptr", "stats_ptr") else "*i32") if name.endswith("_ptr")
             else "i32" if name in SIZES_ARGS else "constexpr" for name in _resolve_kernel.arg_names}
POINTERS = [i for i, t in enumerate(SIGNATURE.values()) if t.startswith("*")]
SIZES = [list(SIGNATURE).index(name) for name in SIZES_ARGS]
SHOWN = ("LDG", "STG", "BAR", "LDS", "STS", "SHFL", "MEMBAR", "ATOMG", "REDG")


def compile_counts(kernel, divisible: list[int], k_pad: int, b_pad: int, warps: int) -> dict:
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=kernel, signature=SIGNATURE, attrs=attrs,
                    constexprs={"K_PAD": k_pad, "B_PAD": b_pad, "SORT_PLAN": False})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
            ops["vector"] += bool(re.match(r"(LDG|STG)\.E\.128", m.group(1)))
    counts = {name: ops[name] for name in SHOWN}
    counts["vec16B"] = ops["vector"]                                           # of the LDG and STG
    counts["all"] = sum(v for name, v in ops.items() if name != "vector")
    counts["convert"] = compiled.asm["ttgir"].count("ttg.convert_layout")     # layout conversions
    return counts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warps", type=int, default=8, help="num_warps (default 8, the launcher's for B >= 2048)")
    ap.add_argument("--k", type=int, default=2048, help="selection size k (default 2048)")
    ap.add_argument("--cache-slots", type=int, default=4096, help="B (default 4096)")
    args = ap.parse_args(argv)
    k_pad, b_pad = triton.next_power_of_2(args.k), triton.next_power_of_2(args.cache_slots)
    variants = {"_resolve_kernel": (_resolve_kernel, POINTERS + SIZES),
                "_resolve_kernel_flat": (_resolve_kernel_flat, POINTERS)}
    rows = {name: compile_counts(fn, div, k_pad, b_pad, args.warps) for name, (fn, div) in variants.items()}
    print(f"Triton {triton.__version__}, sm_90, k={args.k}, B={args.cache_slots}, {args.warps} warps "
          f"(static counts: instructions in the program)")
    names = list(next(iter(rows.values())))
    print(f"{'SASS':22s}" + "".join(f"{n:>8s}" for n in names))
    for variant, counts in rows.items():
        print(f"{variant:22s}" + "".join(f"{counts[n]:8d}" for n in names))


if __name__ == "__main__":
    main()
