"""Summarise Nsight Compute's per-instruction source view of one kernel (no GPU needed).

    python -m experiments.tools.ncu_summary OUT/ncu_resolve_miss_02.sass.csv [--top 15]

Reads the CSV that `ncu -i REPORT --page source --csv --print-source sass` writes (benchmarks/gpu_suite.sh
with NCU=1 does) and prints: instructions issued per warp by opcode and by opcode family, the
warp-stall reasons' shares of all stall samples, and the instructions holding the most samples with
their main stall reason.
"""
import argparse
import io

import pandas as pd


def load(path: str) -> pd.DataFrame:
    lines = open(path).read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))   # after the kernel's name
    frame = pd.read_csv(io.StringIO("\n".join(lines[start:])))
    frame["samples"] = pd.to_numeric(frame["Warp Stall Sampling (All Samples)"], errors="coerce").fillna(0)
    frame["executed"] = pd.to_numeric(frame["Instructions Executed"], errors="coerce").fillna(0)
    # the opcode with its modifiers, without a predicate guard (@P0, @!UP1)
    frame["opcode"] = frame.Source.str.strip().str.replace(r"^@!?U?P\w+\s+", "", regex=True).str.split().str[0]
    return frame


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="a source-view CSV written by ncu --page source --csv --print-source sass")
    ap.add_argument("--top", type=int, default=15, help="instructions and opcodes to list (default 15)")
    args = ap.parse_args(argv)
    frame = load(args.csv)
    stalls = [c for c in frame.columns if c.startswith("stall_") and "Not Issued" not in c]
    counts = frame[stalls].apply(pd.to_numeric, errors="coerce").fillna(0)
    warps = frame.executed.iloc[0]          # the first instruction runs once per warp
    passes = frame.executed.max() / warps   # how often a warp runs its most executed instructions (a loop's)
    print(f"{args.csv}: {len(frame)} SASS instructions, {warps:.0f} warps, "
          f"{frame.executed.sum() / warps:.0f} instructions issued per warp, the most executed ones {passes:.0f} "
          f"times each; {frame.samples.sum():.0f} stall samples")
    print("issued per warp, by opcode:")
    by_opcode = frame.groupby("opcode").executed.sum().sort_values(ascending=False) / warps
    print("  " + ", ".join(f"{op} {n:.0f}" for op, n in by_opcode.head(args.top).items()))
    by_family = frame.groupby(frame.opcode.str.split(".").str[0]).executed.sum().sort_values(ascending=False) / warps
    print("by opcode family (IMAD for IMAD.WIDE, IMAD.IADD, ...):")
    print("  " + ", ".join(f"{op} {n:.0f}" for op, n in by_family.head(args.top).items()))
    print("stall reasons, share of samples:")
    shares = counts.sum().sort_values(ascending=False) / max(1.0, frame.samples.sum())
    print("  " + ", ".join(f"{name[6:]} {share:.3f}" for name, share in shares.head(8).items()))
    print("instructions with the most samples (index, share, main reason, SASS):")
    for i in frame.samples.sort_values(ascending=False).head(args.top).sort_index().index:
        reason = counts.loc[i].idxmax()[6:]
        print(f"  {i:5d} {frame.samples[i] / frame.samples.sum():6.3f} {reason:16s} {frame.Source[i].strip()[:80]}")


if __name__ == "__main__":
    main()
