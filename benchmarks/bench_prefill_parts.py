"""DSA prefill's kernels one at a time, at the last piece of a prompt, each beside its limit: where a
32K or 128K prefill's time goes, part by part, and which of two ways of a part is faster.

    python -m benchmarks.bench_prefill_parts [--out DIR] [--contexts 32768 131072]
    python -m benchmarks.bench_prefill_parts --quick      # tiny shapes on the CPU (Triton's interpreter)

For each prompt length T, the last piece `dsa_prefill_select` makes (rows = PREFILL_SELECT_ELEMENTS // T
queries ending the prompt: 2048 at 32K, 512 at 128K; DeepSeek-V3.2's 64 x 128 indexer, k = 2048), random
inputs, each part timed alone (do_bench medians):
- `indexer` (methods `bf16`, `fp8`): `prefill_indexer_scores` over bf16 keys, and over FP8 keys with the
  query quantised (TFLOP/s of the causal products beside the bf16 matrix rate, and twice it for FP8);
  `--indexer-configs` adds each at other tile configs (`bf16@128,4,8,3`: FP8's operands are half as wide);
- `quantize_query` (`kernel`, `torch_reference`; on the CPU both torch): the FP8 query's rotation and
  quantisation (GB/s of one read of q and w and one write of the e4m3 values and scales, beside HBM);
- `topk` (`torch`, `radix`: `ops.TOPK_METHODS`): `topk_of_indexer_scores` of the piece's scores (GB/s of
  one read of the scores, beside HBM);
- `sparse_mla` (`gluon_prefill` where it runs, else `decode_kernel`): the absorbed sparse MLA of 4096
  queries over the prompt's latents, k picks each (TFLOP/s beside the bf16 matrix rate).
The methods of `quantize_query` and `topk` are checked to give the same bits before they are timed.
Rows: results/prefill_parts.csv.
"""
import argparse

import torch

from benchmarks.common import HBM_BYTES_PER_S, MMA_FLOPS_PER_S, time_us, timer_name
from hisparse.dsa import fp8_index
from hisparse.dsa.ops import (PREFILL_SELECT_ELEMENTS, TOPK_METHODS, PrefillIndexerConfig, prefill_indexer_scores,
                              sparse_mla_decode, topk_of_indexer_scores)
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder
from kernels_triton.dsa_gluon_prefill import prefill_unsupported, sparse_mla_prefill_gluon

EXACT_PARTS = ("quantize_query", "topk")      # parts whose methods must give the same bits
FULL = dict(heads=64, head_dim=128, k=2048, mla_heads=128, latent=512, rope=64, mla_queries=4096, rows=None)
QUICK = dict(heads=8, head_dim=32, k=16, mla_heads=4, latent=32, rope=16, mla_queries=8, rows=4)


def rows_of(context: int, shape: dict) -> int:
    """The queries of a piece at this prompt length (see `parts`; --quick: a few)."""
    return shape["rows"] or min(context, max(1, PREFILL_SELECT_ELEMENTS // context))


def parts(context: int, shape: dict, device: torch.device,
          configs: list[PrefillIndexerConfig] = ()) -> list[tuple[str, str, float, str, object]]:
    """(part, method, work, unit, fn) of one prompt length: work in FLOPs (unit "TFLOPs") or bytes ("GBps");
    the indexer also at each of `configs` (methods "bf16@config", "fp8@config")."""
    gen = torch.Generator(device=device).manual_seed(context)
    h, d, k = shape["heads"], shape["head_dim"], shape["k"]
    rows = rows_of(context, shape)
    start = context - rows
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(rows, h, d, device=device, generator=gen).to(dtype)
    w = torch.rand(rows, h, device=device, generator=gen) * (h * d) ** -0.5
    keys = torch.randn(context, d, device=device, generator=gen).to(dtype)
    values, scales = fp8_index.quantize_keys(keys)
    q8, w8 = fp8_index.quantize_query(q, w)
    lengths = torch.arange(start + 1, context + 1, device=device)
    causal = 2 * h * d * float(lengths.sum())
    scores = prefill_indexer_scores(q, w, keys, start)
    out = []
    for cfg in (None, *configs):
        at = "" if cfg is None else "@" + config_name(cfg)
        out += [("indexer", "bf16" + at, causal, "TFLOPs", lambda c=cfg: prefill_indexer_scores(q, w, keys, start, c)),
                ("indexer", "fp8" + at, causal, "TFLOPs",
                 lambda c=cfg: prefill_indexer_scores(q8, w8, values, start, c, key_scale=scales))]
    moved = q.numel() * q.element_size() + w.numel() * 4 + q.numel() + w.numel() * 4   # q, w in; values, scales out
    out += [("quantize_query", "kernel" if device.type == "cuda" else "torch", moved, "GBps",
             lambda: fp8_index.quantize_query(q, w)),
            ("quantize_query", "torch_reference", moved, "GBps",
             lambda: fp8_index.quantize_query(q, w, reference=True))]
    out += [("topk", method, scores.numel() * 4, "GBps", lambda m=method: topk_of_indexer_scores(scores, lengths, k, m))
            for method in TOPK_METHODS]
    n, hm, dc, dr = min(shape["mla_queries"], context), shape["mla_heads"], shape["latent"], shape["rope"]
    qm = torch.randn(n, hm, dc + dr, device=device, generator=gen).to(dtype)
    kv = torch.randn(context, dc + dr, device=device, generator=gen).to(dtype)
    picks = torch.stack([torch.randperm(context, device=device, generator=gen)[:k] for _ in range(n)]).to(torch.int32)
    scale = (dc + dr) ** -0.5
    mla_flops = 2 * n * hm * (2 * dc + dr) * picks.shape[1]
    if prefill_unsupported(qm, kv, picks) is None:
        mla = ("gluon_prefill", lambda: sparse_mla_prefill_gluon(qm, kv, picks, scale))
    else:
        mla = ("decode_kernel", lambda: sparse_mla_decode(qm, kv, picks, scale, d_v=dc)[0])
    out.append(("sparse_mla", mla[0], mla_flops, "TFLOPs", mla[1]))
    return out


def config_name(cfg: PrefillIndexerConfig) -> str:
    """block_t,queries,warps,stages: as --indexer-configs takes it."""
    return f"{cfg.block_t},{cfg.queries},{cfg.num_warps},{cfg.num_stages}"


def indexer_config(text: str) -> PrefillIndexerConfig:
    """--indexer-configs: "block_t,queries,warps,stages" (PrefillIndexerConfig's checks name a bad field)."""
    try:
        fields = [int(x) for x in text.split(",")]
    except ValueError:
        fields = []
    if len(fields) != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: expected four integers block_t,queries,warps,stages, "
                                         "e.g. 128,4,8,3")
    try:
        return PrefillIndexerConfig(*fields)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def same(a, b) -> bool:
    """Outputs of two methods of a part equal (tuples item by item, e4m3 by their bytes)."""
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    if a.dtype == fp8_index.FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP + " (prefill_parts.csv)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="prompt lengths T (default 32768 131072; --quick 256)")
    ap.add_argument("--indexer-configs", type=indexer_config, nargs="+", default=[], metavar="B,Q,W,S",
                    help="also time the indexer at these configs, block_t,queries,warps,stages each (default: "
                         "only its default config, `ops.default_prefill_indexer_config`)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, through Triton's interpreter")
    args = ap.parse_args(argv)
    check_out_folder(ap, args.out)
    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        ap.error("the full-size run needs a CUDA GPU; --quick runs tiny shapes on the CPU")
    shape = QUICK if args.quick else FULL
    contexts = args.contexts or ([256] if args.quick else [32768, 131072])
    bad = [t for t in contexts if t < shape["k"]]
    if bad:
        ap.error(f"--contexts {bad}: each must be at least k = {shape['k']} tokens")
    device = torch.device("cuda" if gpu else "cpu")
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"{name}: DSA prefill parts; limits: bf16 matrix rate {MMA_FLOPS_PER_S / 1e12:.0f} TFLOP/s (FP8 twice it), "
          f"HBM {HBM_BYTES_PER_S / 1e9:.0f} GB/s (measured H200 figures)")
    print(f"{'T':>7} {'part':15} {'method':16} {'us':>9} {'rate':>14} {'of limit':>8}")
    for context in contexts:
        rows, firsts = [], {}
        for part, method, work, unit, fn in parts(context, shape, device, args.indexer_configs):
            if part in EXACT_PARTS:
                result = fn()
                if not same(firsts.setdefault(part, result), result):
                    raise SystemExit(f"{part} at T = {context}: method {method} differs from the first method's output")
            us = time_us(fn)[0]
            limit = (MMA_FLOPS_PER_S * (2 if method.startswith("fp8") else 1)) if unit == "TFLOPs" else HBM_BYTES_PER_S
            rate = work / us * 1e-6 if unit == "TFLOPs" else work / us * 1e-3
            frac = work / limit / (us * 1e-6)
            print(f"{context:7d} {part:15} {method:16} {us:9.1f} {rate:9.1f} {unit:>4} {frac:8.3f}")
            base = dict(bench="prefill_parts", family="dsa", part=part, method=method, context=context,
                        rows=rows_of(context, shape), k=shape["k"], timer=timer_name(False))
            rows += [dict(base, metric="us", value=us, unit="us"), dict(base, metric=unit, value=rate, unit=unit),
                     dict(base, metric="roofline_frac", value=frac, unit="fraction")]
        append_rows(f"{args.out}/prefill_parts.csv", rows)


if __name__ == "__main__":
    main()
