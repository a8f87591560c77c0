"""DSA prefill's top-k selection: kernels_triton/dsa_topk.py's radix select against torch.topk and
against `topk_of_indexer_scores` (torch.topk, the picks ordered, exact keys for straddling ties), beside
the bytes-read roofline.

    python -m benchmarks.bench_topk [--out DIR] [--rows 4096] [--contexts 32768 131072] [--k 2048]

GPU only. Rows are prefill's: N queries ending a T-token prompt, lengths T - N + 1 .. T, -inf past each
length, random normal scores. Printed per call: median us (do_bench, p20-p80), and the roofline of
3 reads of the valid scores (the radix select's two narrowing passes and its write pass on rows like
these; torch.topk is printed against one read) at HBM_BYTES_PER_S = 4.8e12 B/s, the H200's spec
(benchmarks.common's 4.3e12 is the measured copy rate). With --out, rows go to DIR/topk.csv.
"""
import argparse
import sys

import torch

from benchmarks.common import time_us, timer_name
from hisparse.dsa.ops import topk_of_indexer_scores, topk_select
from hisparse.results import append_rows, check_out_folder
from kernels_triton.dsa_topk import radix_topk

HBM_BYTES_PER_S = 4.8e12        # H200 spec
RADIX_READS = 3                 # narrowing passes (2) and the write pass, on rows of distinct scores


def prefill_rows(n: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(n, t, device="cuda", generator=gen)
    lengths = torch.arange(t - n + 1, t + 1, device="cuda")
    scores.masked_fill_(torch.arange(t, device="cuda")[None, :] >= lengths[:, None], float("-inf"))
    return scores, lengths


def methods(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> dict:
    """name -> (the call timed, how many reads of the scores its roofline counts)."""
    return {"radix_topk": (lambda: radix_topk(scores, lengths, k), RADIX_READS),
            "torch.topk": (lambda: scores.topk(k, dim=1, sorted=False), 1),
            "topk_of_indexer_scores": (lambda: topk_of_indexer_scores(scores, lengths, k), 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder of the results CSVs (topk.csv); no rows without it")
    ap.add_argument("--rows", type=int, default=4096, help="queries N per call (default 4096)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="prompt lengths T")
    ap.add_argument("--k", type=int, default=2048, help="picks per row (default 2048)")
    args = ap.parse_args(argv)
    if args.out is not None:
        check_out_folder(ap, args.out)
    if not torch.cuda.is_available():
        sys.exit("bench_topk needs a CUDA GPU (the interpreter's times say nothing about the kernel)")
    bad = [v for v in [args.rows, args.k, *args.contexts] if v < 1]
    if bad or any(args.rows > t for t in args.contexts):
        ap.error(f"--rows, --k and --contexts must be positive and rows <= every context, got {bad or args.rows}")
    print(f"HBM roofline at {HBM_BYTES_PER_S:.1e} B/s (H200 spec); radix select counted as {RADIX_READS} reads")
    print(f"{'T':>7} {'N':>5} {'k':>5} | {'method':>22} {'us':>10} {'p20-p80':>17} | {'roofline us':>11} {'frac':>5}")
    for t in args.contexts:
        scores, lengths = prefill_rows(args.rows, t)
        assert torch.equal(radix_topk(scores, lengths, args.k)[0], topk_select(scores, lengths, args.k))
        valid_bytes = 4 * float(lengths.sum())
        rows = []
        for name, (fn, reads) in methods(scores, lengths, args.k).items():
            median, p20, p80 = time_us(fn)
            # torch.topk reads every row in full, -inf included; the radix select only the valid scores
            read_bytes = reads * (valid_bytes if name == "radix_topk" else 4.0 * args.rows * t)
            roofline = read_bytes / HBM_BYTES_PER_S * 1e6
            print(f"{t:7d} {args.rows:5d} {args.k:5d} | {name:>22} {median:10.1f} {p20:8.1f}-{p80:<8.1f} | "
                  f"{roofline:11.1f} {roofline / median:5.2f}", flush=True)
            base = dict(bench="topk", method=name, batch=args.rows, context=t, k=args.k, timer=timer_name(False),
                        read_bytes=read_bytes, hbm_bytes_per_s=HBM_BYTES_PER_S)
            rows += [dict(base, metric="us", value=median, unit="us"),
                     dict(base, metric="p20_us", value=p20, unit="us"), dict(base, metric="p80_us", value=p80, unit="us"),
                     dict(base, metric="roofline_frac", value=roofline / median, unit="fraction")]
        if args.out is not None:
            append_rows(f"{args.out}/topk.csv", rows)
        del scores
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
