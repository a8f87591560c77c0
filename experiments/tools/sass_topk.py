"""Compile the radix top-k kernel (kernels_triton/topk.py) for sm_90 without a GPU and report what it
holds and does (no device time): registers, spills and shared memory per program, and the SASS of its
innermost loops (static counts, one trip: a `_split` block of --block scores, a radix pass's histogram
block over the row (--block) or the candidates (512), the last pass's 512 picks).

    TRITON_INTERPRET=0 python -m experiments.tools.sass_topk [--block 2048] [--sample 512] [--bins 32 2048]

Without options: the launcher's GPU defaults for rows of 32K scores (block 2048: 8 warps, 8 scores a
thread in `_split`; sample 512) and for 128K (sample 2048). --bins compiles a bare loop of
tl.histogram over a block for each bin count, to show what a radix pass's histogram costs (the
reason for 32 bins: VOTE is a warp ballot, POPC a popcount). Pointers and row strides are taken
16-byte aligned, as a launch on contiguous tensors specialises them. Compiled and read by
experiments/tools/sass.py.
"""
import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl

from experiments.tools.sass import TOOLS, compile_sm90, registers_and_spills, sass_ops
from kernels_triton.topk import BINS, CAPACITY
from kernels_triton.topk import _radix_topk_kernel as KERNEL

POINTER_TYPES = {"scores_ptr": "*fp32", "len_ptr": "*i32", "val_ptr": "*fp32", "id_ptr": "*i64", "work_ptr": "*i32"}
SIGNATURE = {name: POINTER_TYPES.get(name) or ("fp32" if name == "MARGIN" else
                                              "constexpr" if name.isupper() and name not in ("T", "K", "KPAD")
                                              else "i32")
             for name in KERNEL.arg_names}
ALIGNED = ("stride_sn", "stride_vn", "stride_in", "stride_wn", "KPAD")
SHOWN = ("LDG", "STG", "BAR", "VOTE", "POPC", "ATOMS", "SHFL", "LDS", "STS", "STL", "LDL")   # STL/LDL: spills


def sass_text(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """(instructions, opcode -> count) of each innermost loop in the SASS: the span of a backward
    branch that holds no other."""
    program = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            program.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())))
    spans = []
    for addr, text in program:
        branch = re.match(r"U?BRA\S*\s+.*?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < addr:
            spans.append((int(branch.group(1), 16), addr))
    innermost = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [(len(body), collections.Counter(t.split()[0].split(".")[0] for t in body))
            for a, b in innermost for body in [[t for x, t in program if a <= x <= b]]]


def kind(counts: collections.Counter) -> str:
    """What a loop of the kernel is, by what it does: a `_split` block (a scan: SHFL, then stores),
    a radix pass's histogram (Triton 3.6: ballots, VOTE; later versions: shared atomics, ATOMS), or
    the last pass writing the picks (stores alone)."""
    if counts["VOTE"] or counts["ATOMS"]:
        return "histogram"
    return "split" if counts["SHFL"] else "picks" if counts["STG"] else "scalar"


def report(block: int, sample: int) -> None:
    warps = 8 if block >= 2048 else 4
    constexprs = {"BLOCK": block, "SBLOCK": min(block, 512), "SAMPLE": sample, "CAP": CAPACITY, "BINS": BINS,
                  "COLS": 32 * warps, "E": block // (32 * warps)}
    names = list(SIGNATURE)
    divisible = [i for i, t in enumerate(SIGNATURE.values()) if t.startswith("*")] + [names.index(n) for n in ALIGNED]
    compiled = compile_sm90(KERNEL, SIGNATURE, constexprs, divisible, num_warps=warps)
    regs, spills = registers_and_spills(compiled)
    ops = sass_ops(compiled)
    print(f"block {block} ({warps} warps, {constexprs['E']} scores a thread in _split), sample {sample}: "
          f"{regs} regs, {spills} B spilled, {compiled.metadata.shared} B shared, "
          f"{sum(v for k, v in ops.items() if k != 'vec16B')} instructions, {ops['vec16B']} 16-byte loads")
    for n, counts in loops(sass_text(compiled)):
        name = kind(counts)
        if name == "scalar":
            continue
        per = f" ({n / (block // warps):.2f} a score, per warp)" if name == "split" else ""
        print(f"  {name:9s} loop: {n:4d} instructions a trip{per}: "
              + " ".join(f"{op} {counts[op]}" for op in SHOWN if counts[op]))


@triton.jit
def _histogram_loop(x_ptr, out_ptr, T, BLOCK: tl.constexpr, BINS: tl.constexpr):
    acc = tl.zeros([BINS], dtype=tl.int32)
    for t0 in range(0, T, BLOCK):
        o = t0 + tl.arange(0, BLOCK)
        acc += tl.histogram(tl.load(x_ptr + o, mask=o < T, other=0) & (BINS - 1), BINS, mask=o < T)
    tl.store(out_ptr + tl.arange(0, BINS), acc)


def report_histogram(bins: int, block: int = 2048, warps: int = 8) -> None:
    compiled = compile_sm90(_histogram_loop, {"x_ptr": "*i32", "out_ptr": "*i32", "T": "i32", "BLOCK": "constexpr",
                                              "BINS": "constexpr"}, {"BLOCK": block, "BINS": bins}, [0, 1],
                            num_warps=warps)
    n, counts = max(loops(sass_text(compiled)), key=lambda loop: loop[0])
    per_warp = block // warps
    print(f"tl.histogram of {bins} bins: {n / per_warp:.2f} instructions a key (per warp), "
          f"{counts['POPC'] / per_warp:.3f} POPC and {counts['VOTE'] / per_warp:.3f} VOTE a key")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block", type=int, default=2048, help="scores a pass reads at once (default %(default)s)")
    ap.add_argument("--sample", type=int, nargs="*", default=[512, 2048],
                    help="the guess's sample sizes (default %(default)s: T / 64 at 32K and 128K)")
    ap.add_argument("--bins", type=int, nargs="*", default=[32, 2048], help="histogram sizes to cost (default %(default)s)")
    args = ap.parse_args(argv)
    print(f"Triton {triton.__version__}, sm_90a, capacity {CAPACITY}")
    for sample in args.sample:
        report(args.block, sample)
    for bins in args.bins:
        report_histogram(bins)


if __name__ == "__main__":
    main()
