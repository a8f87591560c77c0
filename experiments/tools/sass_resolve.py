"""Compile the resolve kernel for sm_90 without a GPU and count what its SASS does (no device time).

    TRITON_INTERPRET=0 python -m experiments.tools.sass_resolve [--warps 8] [--k 2048] [--cache-slots 4096]

The variants of kernels_triton/resolve.py's `_resolve_kernel` are compiled as a launch at these sizes
would specialise them: every pointer 16-byte aligned, K and B unspecialised (do_not_specialize); with
one scan over the LRU order or `packed_scan` (the free slots ranked by one scan over half as many
elements), and that one writing a DSA row per stream too (`newest`, the decode step's write in the
same launch). Printed per
variant: SASS instructions in all, global loads and stores (and how many are 16-byte vectors), block
barriers, shared-memory traffic, warp shuffles, and the layout conversions in the Triton GPU IR.
Compiled and read by experiments/tools/sass.py (the cuobjdump that ships with Triton's NVIDIA backend). The
counts are static (instructions in the program, not executed); the Triton version here may differ
from the GPU machine's.
"""
import argparse

import triton

from experiments.tools.sass import compile_sm90, sass_ops
from kernels_triton.resolve import _resolve_kernel

SIZES_ARGS = ("K", "B")
I64_POINTERS = ("host_base_ptr", "stats_ptr", "new_unit_ptr")
SIGNATURE = {name: ("*i64" if name in I64_POINTERS else "*i32") if name.endswith("_ptr")
             else "i32" if name in SIZES_ARGS else "constexpr" for name in _resolve_kernel.arg_names}
POINTERS = [i for i, t in enumerate(SIGNATURE.values()) if t.startswith("*")]
SHOWN = ("LDG", "STG", "BAR", "LDS", "STS", "SHFL", "MEMBAR", "ATOMG", "REDG")


DSA_ROW_WORDS = 288       # a DSA row (576 bf16) in the int32 words the launcher moves


def compile_counts(kernel, divisible: list[int], k_pad: int, b_pad: int, warps: int, even: bool,
                   packed_scan: bool = False, newest: bool = False) -> dict:
    constexprs = {"K_PAD": k_pad, "B_PAD": b_pad, "EVEN": even, "PACKED_SCAN": packed_scan,
                  "WRITE_NEWEST": newest, "ROW_WORDS": DSA_ROW_WORDS if newest else 1,
                  "BLOCK_W": triton.next_power_of_2(DSA_ROW_WORDS) if newest else 1}
    compiled = compile_sm90(kernel, SIGNATURE, constexprs, divisible, num_warps=warps)
    ops = sass_ops(compiled)
    counts = {name: ops[name] for name in SHOWN}
    counts["vec16B"] = ops["vec16B"]                                           # of the LDG and STG
    counts["all"] = sum(v for name, v in ops.items() if name != "vec16B")
    counts["convert"] = compiled.asm["ttgir"].count("ttg.convert_layout")     # layout conversions
    return counts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warps", type=int, default=8, help="num_warps (default 8, the launcher's for B >= 2048)")
    ap.add_argument("--k", type=int, default=2048, help="selection size k (default 2048)")
    ap.add_argument("--cache-slots", type=int, default=4096, help="B (default 4096)")
    args = ap.parse_args(argv)
    k_pad, b_pad = triton.next_power_of_2(args.k), max(2, triton.next_power_of_2(args.cache_slots))  # as resolve()
    variants = {"single scan": (_resolve_kernel, POINTERS, False, False),
                "packed_scan": (_resolve_kernel, POINTERS, True, False),       # resolve()'s default to B = 32768
                "packed, newest": (_resolve_kernel, POINTERS, True, True)}     # + DSA's newest rows
    if b_pad > 1 << 15:                  # resolve() refuses packed_scan there (its halves count in 16 bits)
        del variants["packed_scan"], variants["packed, newest"]
    even = (k_pad, b_pad) == (args.k, args.cache_slots)           # as the launcher passes EVEN
    rows = {name: compile_counts(fn, div, k_pad, b_pad, args.warps, even, packed, newest)
            for name, (fn, div, packed, newest) in variants.items()}
    print(f"Triton {triton.__version__}, sm_90, k={args.k}, B={args.cache_slots}, {args.warps} warps "
          f"(static counts: instructions in the program)")
    names = list(next(iter(rows.values())))
    print(f"{'SASS':22s}" + "".join(f"{n:>8s}" for n in names))
    for variant, counts in rows.items():
        print(f"{variant:22s}" + "".join(f"{counts[n]:8d}" for n in names))


if __name__ == "__main__":
    main()
