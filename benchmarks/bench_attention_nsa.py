"""NSA decode: the Triton kernels beside a torch gather baseline and dense attention.

    python -m benchmarks.bench_attention_nsa [--out DIR] [--quick] [--cudagraph] [--breakdown] [--tune]
        [--batches 1 32 ...] [--contexts 8192 ...]

Modes, in one run, per (batch, context), every request `context` tokens long:
- `triton`: hisparse.nsa.ops.nsa_decode over the resident pool (compressed branch, selection scores and
  top-16 per KV head, selected blocks, window, gates: six launches);
- `torch_gather`: hisparse.nsa_ref.nsa_decode_ref in bf16 (the same step in torch: gather the selected
  rows, then matmul-softmax-matmul per branch);
- `dense`: torch's scaled_dot_product_attention over the whole context (the G query heads of a KV
  head as G queries of one head).
Appends `us`, `TFLOPs`, `GBps`, `roofline_frac` rows (family `nsa`) to DIR/attention.csv. The
sparse modes count the work of an ideal NSA step: every key and value of the three branches read
once (compressed blocks, 16 blocks of 64, the 512-token window), 4 * H * D FLOPs per key, plus q
and out; the selection's own traffic (fp32 logits, a few % of the bytes) is not counted. Dense
counts the whole context the same way. roofline_frac = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)
over the measured time. `--cudagraph` times graph replays (as the decode loop runs), without the
launch overhead of six launches; `--tune` times NsaConfig choices at one shape (prints only).
`--quick` runs a tiny configuration that also works on the CPU interpreter.
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import (
    HBM_BYTES_PER_S,
    MMA_FLOPS_PER_S,
    metric_rows,
    print_table,
    time_us,
    timer_name,
)
from hisparse.nsa import ops as nsa
from hisparse.nsa import reference as nsa_ref
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder

FULL = dict(batches=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(8192, 16384, 32768, 65536, 131072),
            heads=32, kv_heads=8, d=128, n_select=nsa.N_SELECT, window=nsa.WINDOW)
QUICK = dict(batches=(1, 3), contexts=(300,), heads=4, kv_heads=2, d=32, n_select=4, window=128)


def sparse_keys(context: int, cfg: dict) -> int:
    """Keys one query head attends over per request: compressed blocks + selected tokens + window."""
    n_cmp = (context - nsa.CMP_BLOCK) // nsa.CMP_STRIDE + 1 if context >= nsa.CMP_BLOCK else 0
    selected = min(context, cfg["n_select"] * nsa.SEL_BLOCK)
    return n_cmp + selected + min(context, cfg["window"])


def work(batch: int, keys: int, cfg: dict, elem: int) -> tuple[float, float]:
    """(FLOPs, bytes) of an ideal decode over `keys` keys and values per (request, KV head)."""
    h, kvh, d = cfg["heads"], cfg["kv_heads"], cfg["d"]
    flops = 4.0 * batch * h * d * keys
    nbytes = elem * batch * (kvh * keys * 2 * d + 2 * h * d)
    return flops, nbytes


class Step:
    """Inputs of one NSA decode step at (batch, context): resident pool, compressed KV, window."""

    def __init__(self, batch, context, cfg, device, gen):
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        h, kvh, d = cfg["heads"], cfg["kv_heads"], cfg["d"]
        self.cfg, self.batch, self.context = cfg, batch, context
        self.n_units = triton.cdiv(context, nsa.SEL_BLOCK)
        n_cmp = (context - nsa.CMP_BLOCK) // nsa.CMP_STRIDE + 1

        def rnd(*shape):
            return torch.randn(*shape, device=device, dtype=self.dtype, generator=gen)

        self.q = rnd(batch, h, d)
        self.pool = rnd(batch * kvh * self.n_units, 2, nsa.SEL_BLOCK, d)
        self.ck, self.cv = rnd(batch, kvh, n_cmp, d), rnd(batch, kvh, n_cmp, d)
        self.win_k, self.win_v = rnd(batch, kvh, cfg["window"], d), rnd(batch, kvh, cfg["window"], d)
        self.gates = torch.rand(batch, h, 3, device=device, generator=gen).to(self.dtype)
        self.lengths = torch.full((batch,), context, dtype=torch.int32, device=device)

    @staticmethod
    def nbytes(batch, context, cfg, elem) -> int:
        n_cmp = (context - nsa.CMP_BLOCK) // nsa.CMP_STRIDE + 1
        per_stream = (triton.cdiv(context, nsa.SEL_BLOCK) * nsa.SEL_BLOCK + n_cmp + cfg["window"]) * 2 * cfg["d"]
        return elem * batch * cfg["kv_heads"] * per_stream

    def triton(self, config=nsa.DEFAULT_CONFIG):
        return nsa.nsa_decode(self.q, self.ck, self.cv, self.pool, self.win_k, self.win_v, self.lengths,
                              self.gates, self.n_units, n_select=self.cfg["n_select"], config=config)

    def torch_gather(self):
        return nsa_ref.nsa_decode_ref(self.q, self.ck, self.cv, self.pool, self.win_k, self.win_v, self.lengths,
                                  self.gates, self.n_units, self.cfg["n_select"], dtype=self.dtype)

    def verify(self, out, blocks, requests=2):
        """Triton vs the fp32 reference on the first requests: scores, top-n on those scores, output."""
        r = min(requests, self.batch)
        q, lengths = self.q[:r], self.lengths[:r]
        _, lse, logits = nsa.nsa_compressed_attention(q, self.ck[:r], self.cv[:r], lengths)
        _, scores = nsa.nsa_select(logits, lse, lengths, self.cfg["kv_heads"], self.n_units, self.cfg["n_select"])
        o_cmp, probs = nsa_ref.nsa_compressed_attention_ref(q, self.ck[:r], self.cv[:r], lengths)
        ref_scores = nsa_ref.nsa_selection_scores_ref(probs, self.n_units)
        checks = {"scores": rel_err(scores, ref_scores)}
        if not torch.equal(blocks[:r], nsa_ref.nsa_topn_ref(scores, lengths, self.cfg["n_select"])):
            raise RuntimeError(f"top-n of batch={self.batch} context={self.context} differs from nsa_topn_ref")
        pool = self.pool[: r * self.cfg["kv_heads"] * self.n_units]
        o_slc = nsa_ref.nsa_selected_attention_ref(q, pool, nsa.resident_rows(blocks[:r], self.n_units), blocks[:r],
                                               lengths)
        o_win = nsa_ref.nsa_window_attention_ref(q, self.win_k[:r], self.win_v[:r], lengths)
        checks["out"] = rel_err(out[:r], nsa_ref.nsa_gate_ref(self.gates[:r], o_cmp, o_slc, o_win))
        for name, err in checks.items():
            if not err < 2e-2:
                raise RuntimeError(f"triton {name} at batch={self.batch} context={self.context}: rel err {err:.3g}")


def rel_err(actual, expected) -> float:
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item()


def dense_decode(q, k, v):
    """SDPA over the whole context: q [N, H, D] as [N, KV, G, D] against k, v [N, KV, T, D]."""
    n, h, d = q.shape
    return F.scaled_dot_product_attention(q.view(n, k.shape[1], h // k.shape[1], d), k, v).view(n, h, d)


def fits(nbytes: int, device) -> bool:
    return device.type != "cuda" or nbytes < 0.85 * torch.cuda.mem_get_info()[0]


def run_shape(batch, context, cfg, device, gen, cudagraph) -> tuple[list[dict], dict]:
    """Time the three modes at one shape; returns result rows and {mode: us}."""
    elem = 2 if device.type == "cuda" else 4
    base = {"bench": "attention", "family": "nsa", "batch": batch, "context": context, "heads": cfg["heads"],
            "kv_heads": cfg["kv_heads"], "head_dim": cfg["d"], "timer": timer_name(cudagraph)}
    rows_out, times = [], {}

    def timed(mode, fn, keys, extra):
        try:
            us, p20, p80 = time_us(fn, cudagraph)
        except torch.OutOfMemoryError:
            print(f"  {mode:12s} batch={batch} context={context}: out of memory, skipped")
            return
        except Exception as exc:  # noqa: BLE001 -- e.g. a mode that cannot be captured: keep the others
            print(f"  {mode:12s} batch={batch} context={context}: skipped, {type(exc).__name__}: {str(exc)[:300]}")
            return
        times[mode] = us
        flops, nbytes = work(batch, keys, cfg, elem)
        rows_out.extend(metric_rows({**base, "mode": mode, **extra, "us_p20": p20, "us_p80": p80}, us, flops, nbytes))

    sparse = {"k": cfg["n_select"], "unit_bytes": 2 * nsa.SEL_BLOCK * cfg["d"] * elem, "window": cfg["window"]}
    if fits(Step.nbytes(batch, context, cfg, elem) * 1.1, device):
        step = Step(batch, context, cfg, device, gen)
        out, blocks = step.triton()
        step.verify(out, blocks)
        timed("triton", step.triton, sparse_keys(context, cfg), sparse)
        timed("torch_gather", step.torch_gather, sparse_keys(context, cfg), sparse)
        del step, out, blocks
    else:
        print(f"  batch={batch} context={context}: the resident pool does not fit, sparse modes skipped")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dense_bytes = elem * batch * cfg["kv_heads"] * context * 2 * cfg["d"]
    if fits(dense_bytes * 1.1, device):
        shape = (batch, cfg["kv_heads"], context, cfg["d"])
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        k = torch.randn(*shape, device=device, dtype=dtype, generator=gen)
        v = torch.randn(*shape, device=device, dtype=dtype, generator=gen)
        q = torch.randn(batch, cfg["heads"], cfg["d"], device=device, dtype=dtype, generator=gen)
        timed("dense", lambda: dense_decode(q, k, v), context, {})
        del k, v, q
    else:
        print(f"  batch={batch} context={context}: dense KV does not fit, dense skipped")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows_out, times


def breakdown(batch, context, cfg, device, gen, cudagraph) -> None:
    """Time each launch group of the triton step (prints only)."""
    step = Step(batch, context, cfg, device, gen)
    q, lengths, kvh = step.q, step.lengths, cfg["kv_heads"]
    _, lse, logits = nsa.nsa_compressed_attention(q, step.ck, step.cv, lengths)
    blocks, _ = nsa.nsa_select(logits, lse, lengths, kvh, step.n_units, cfg["n_select"])
    o = torch.zeros(batch, cfg["heads"], cfg["d"], device=device)
    parts = {
        "compressed": lambda: nsa.nsa_compressed_attention(q, step.ck, step.cv, lengths),
        "select": lambda: nsa.nsa_select(logits, lse, lengths, kvh, step.n_units, cfg["n_select"]),
        "selected": lambda: nsa.nsa_selected_attention(q, step.pool, None, blocks, lengths, n_units=step.n_units),
        "window": lambda: nsa.nsa_window_attention(q, step.win_k, step.win_v, lengths),
        "gate": lambda: nsa.nsa_gate(step.gates, o, o, o, q.dtype),
        "whole step": step.triton,
    }
    print(f"  breakdown at batch={batch} context={context}:", end="")
    for name, fn in parts.items():
        print(f" {name} {time_us(fn, cudagraph)[0]:.1f} us;", end="")
    print()


def sweep(cfg: dict, device: torch.device, out_dir: Path, cudagraph: bool, with_breakdown: bool) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"NSA decode: heads={cfg['heads']} kv_heads={cfg['kv_heads']} D={cfg['d']} n={cfg['n_select']}"
          f" blocks of {nsa.SEL_BLOCK}, compressed {nsa.CMP_BLOCK}/{nsa.CMP_STRIDE}, window {cfg['window']},"
          f" timer {timer_name(cudagraph)}"
          f" on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}")
    print(f"{'batch':>6s} {'context':>8s} {'mode':13s} {'us':>10s} {'TFLOP/s':>12s} {'GB/s':>13s}"
          f" {'roofline':>9s} {'vs gather':>10s}")
    misses = []
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            rows, times = run_shape(batch, context, cfg, device, gen, cudagraph)
            print_table(rows, times)
            append_rows(out_dir / "attention.csv", rows)
            frac = next((r["value"] for r in rows if r["mode"] == "triton" and r["metric"] == "roofline_frac"), None)
            if batch >= 32 and frac is not None and frac < 0.4:
                misses.append((batch, context, frac))
            if with_breakdown and batch in (1, 32, 128):
                breakdown(batch, context, cfg, device, gen, cudagraph)
    if max(cfg["batches"]) >= 32:
        print("target (batch >= 32): triton roofline_frac >= 0.40:",
              "met everywhere" if not misses else f"missed at {[(b, c, round(f, 3)) for b, c, f in misses]}")


def tune(cfg: dict, device: torch.device, batch: int, context: int, cudagraph: bool) -> None:
    """Time NsaConfig choices at one shape, best last; prints only."""
    gen = torch.Generator(device=device).manual_seed(0)
    step = Step(batch, context, cfg, device, gen)
    flops, nbytes = work(batch, sparse_keys(context, cfg), cfg, step.q.element_size())
    roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
    ref = step.triton()[0].float()
    results = []
    for entry, target, warps, stages in itertools.product((32, 64, 128), (256, 1024, 4096), (4, 8), (1, 2, 3)):
        config = nsa.NsaConfig(entry_tokens=entry, target_programs=target, num_warps=warps, num_stages=stages)
        try:
            err = rel_err(step.triton(config)[0], ref)
            us = time_us(lambda: step.triton(config), cudagraph)[0]
        except Exception as exc:  # a config that does not fit (shared memory, registers) is skipped
            print(f"  {config}: {type(exc).__name__}")
            continue
        results.append((us, config, err))
        print(f"  {us:10.1f} us  {config}", flush=True)
    print(f"tune at batch={batch} context={context}: roofline {roofline_us:.1f} us (default {nsa.DEFAULT_CONFIG})")
    for us, config, err in sorted(results, key=lambda r: -r[0]):
        print(f"  {us:10.1f} us  roofline_frac {roofline_us / us:.3f}  rel err vs default {err:.1e}  {config}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (CPU interpreter too)")
    parser.add_argument("--cudagraph", action="store_true", help="time CUDA graph replays (GPU only)")
    parser.add_argument("--breakdown", action="store_true", help="also time each launch group at batch 1, 32, 128")
    parser.add_argument("--batches", type=int, nargs="+", help="override the batches of the sweep")
    parser.add_argument("--contexts", type=int, nargs="+", help="override the contexts of the sweep")
    parser.add_argument("--tune", action="store_true", help="time NsaConfig choices instead of the sweep")
    parser.add_argument("--tune-batch", type=int, default=32, help="batch of --tune")
    parser.add_argument("--tune-context", type=int, default=32768, help="context of --tune")
    args = parser.parse_args()
    check_out_folder(parser, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        raise SystemExit("the full sweep needs a CUDA GPU; use --quick on the CPU")
    if device.type == "cpu" and args.cudagraph:
        raise SystemExit("--cudagraph needs a CUDA GPU")
    bad = [n for n in (args.batches or []) + (args.contexts or []) + [args.tune_batch, args.tune_context] if n < 1]
    if bad:
        parser.error(f"batches, contexts and --tune-batch / --tune-context must be positive, got {bad[0]}")
    short = [c for c in (args.contexts or []) + [args.tune_context] if c < nsa.CMP_BLOCK]
    if short:       # the compressed branch needs one whole block of CMP_BLOCK tokens
        parser.error(f"context {short[0]}: expected at least {nsa.CMP_BLOCK} tokens (one compressed block)")
    cfg = dict(QUICK if args.quick else FULL)
    cfg["batches"] = tuple(args.batches or cfg["batches"])
    cfg["contexts"] = tuple(args.contexts or cfg["contexts"])
    if args.tune:
        tune(cfg, device, args.tune_batch, cfg["contexts"][0] if args.quick else args.tune_context, args.cudagraph)
    else:
        sweep(cfg, device, args.out, args.cudagraph, args.breakdown)


if __name__ == "__main__":
    main()
