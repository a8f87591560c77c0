"""Quest decode: the Triton kernels beside a torch gather baseline and dense attention.

    python -m benchmarks.bench_attention_quest [--out DIR] [--quick] [--tune]

Modes, in one run (family `quest`, rows appended to DIR/attention.csv):
- `triton`: hisparse.quest.ops.quest_attention over budget/16 selected pages per KV head, read through
  rows of a resident pool (one [2, 16, D] row per (page, KV head)).
- `torch_gather`: gather the same rows, then matmul-softmax(float32)-matmul in torch.
- `dense`: torch's scaled_dot_product_attention over the whole context (hisparse.quest.ops.dense_attention,
  what the first two layers run).
- `triton_score`, `triton_select`: the page scores over the min/max metadata and the top-page
  selection; `triton_step`: score + select + resident rows + attention, one whole Quest decode step
  of a layer.
Each mode counts the work of its ideal kernel: bytes read once from HBM (selected rows or the whole
context, metadata, scores) plus q and out; FLOPs 4*HQ*D per attended key. The roofline is the binding
one of HBM 4.3 TB/s and bf16 matrix 790 TFLOP/s; `roofline_frac` = roofline time / measured time.
`--tune` times attention configurations (pages per step, splits) at one shape, with no CSV rows.
`--quick` runs a tiny configuration that also works on the CPU interpreter.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from benchmarks.common import metric_rows as common_metric_rows
from benchmarks.common import time_us, timer_name
from hisparse.quest import ops as quest
from hisparse.quest.ops import PAGE
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder

FULL = dict(batches=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(8192, 16384, 32768, 65536, 131072),
            heads=32, kv_heads=8, head_dim=128, budget=2048)
QUICK = dict(batches=(1, 3), contexts=(256,), heads=4, kv_heads=2, head_dim=32, budget=64)
TARGET_FRAC, TARGET_BATCH = 0.4, 32


def torch_gather_attention(q, kv, rows, pages, lengths, scale):
    """The torch baseline: gather the selected rows, matmul, softmax (float32), matmul."""
    n, hq, d = q.shape
    hkv, k = rows.shape[1], rows.shape[2]
    picked = kv[rows.clamp(min=0).long()]  # [N, HKV, K, 2, PAGE, D]
    keys = picked[:, :, :, 0].reshape(n, hkv, k * PAGE, d)
    values = picked[:, :, :, 1].reshape(n, hkv, k * PAGE, d)
    pos = pages.long().unsqueeze(-1) * PAGE + torch.arange(PAGE, device=q.device)  # [N, HKV, K, PAGE]
    valid = (rows >= 0).unsqueeze(-1) & (pos < lengths.view(n, 1, 1, 1))
    logits = (q.view(n, hkv, hq // hkv, d) @ keys.transpose(-1, -2)).float() * scale  # [N, HKV, G, K*PAGE]
    logits.masked_fill_(~valid.view(n, hkv, 1, k * PAGE), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return (probs.to(q.dtype) @ values).view(n, hq, d)


def random_pages(batch, kv_heads, n_pages, k, device, gen):
    """[N, HKV, K] int32: K - 1 distinct random earlier pages in page order, then the current page."""
    others = min(k - 1, n_pages - 1)
    earlier = torch.rand(batch, kv_heads, n_pages - 1, device=device, generator=gen).topk(others, dim=-1).indices
    current = torch.full((batch, kv_heads, 1), n_pages - 1, device=device, dtype=torch.int64)
    pages = torch.cat([earlier.sort(dim=-1).values, current], dim=-1).to(torch.int32)
    return torch.nn.functional.pad(pages, (0, k - pages.shape[-1]), value=-1)


def metric_rows(base: dict, us: float, p20: float, p80: float, flops: float, nbytes: float) -> list[dict]:
    return [dict(row, us_p20=p20, us_p80=p80) for row in common_metric_rows(base, us, flops, nbytes)]


class Shape:
    """One (batch, context) point: sizes and the ideal work of each mode."""

    def __init__(self, cfg: dict, batch: int, context: int, dtype: torch.dtype):
        self.batch, self.context = batch, context
        self.hq, self.hkv, self.d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        self.k = cfg["budget"] // PAGE
        self.n_pages = triton.cdiv(context, PAGE)
        self.elem = torch.finfo(dtype).bits // 8
        self.row_bytes = 2 * PAGE * self.d * self.elem
        self.qo_bytes = 2 * batch * self.hq * self.d * self.elem

    def attention_work(self, keys_per_head: int, row_reads: int) -> tuple[float, float]:
        flops = 4.0 * self.batch * self.hq * keys_per_head * self.d
        nbytes = row_reads * self.row_bytes + self.qo_bytes
        return flops, nbytes

    def work(self, mode: str) -> tuple[float, float]:
        streams = self.batch * self.hkv
        sel = self.attention_work(self.k * PAGE, streams * self.k)
        sel = (sel[0], sel[1] + streams * self.k * 8)  # + rows and pages (int32)
        meta = 2.0 * streams * self.n_pages * self.d * self.elem + self.batch * self.hq * self.d * self.elem
        scores = 4.0 * streams * self.n_pages
        if mode in ("triton", "torch_gather"):
            return sel
        if mode == "dense":
            return self.attention_work(self.context, streams * self.n_pages)
        if mode == "triton_score":
            return 0.0, meta + scores
        if mode == "triton_select":
            return 0.0, scores + streams * self.k * 4
        if mode == "triton_step":
            return sel[0], sel[1] + meta + 2 * scores
        raise ValueError(f"unknown mode {mode}")


def sparse_inputs(shape: Shape, device, dtype, gen) -> dict:
    """Resident pool, metadata, q, lengths (all at the full context), a random selection and its rows."""
    n, hq, hkv, d = shape.batch, shape.hq, shape.hkv, shape.d
    pool = torch.empty(n * hkv * shape.n_pages, 2, PAGE, d, device=device, dtype=dtype).normal_(generator=gen)
    kmin = torch.empty(n, hkv, shape.n_pages, d, device=device, dtype=dtype).normal_(generator=gen)
    kmax = torch.empty_like(kmin).normal_(generator=gen)
    q = torch.randn(n, hq, d, device=device, dtype=dtype, generator=gen)
    lengths = torch.full((n,), shape.context, device=device, dtype=torch.int32)
    pages = random_pages(n, hkv, shape.n_pages, shape.k, device, gen)
    rows = quest.resident_rows(pages, shape.n_pages)
    return dict(q=q, kv=pool, rows=rows, pages=pages, lengths=lengths, kmin=kmin, kmax=kmax)


def sparse_modes(shape: Shape, device, dtype, gen) -> dict:
    """The modes over a resident pool, as {mode: fn}; checks triton against torch_gather first."""
    x = sparse_inputs(shape, device, dtype, gen)
    q, pool, rows, pages, lengths, kmin, kmax = (x[key] for key in ("q", "kv", "rows", "pages", "lengths",
                                                                    "kmin", "kmax"))
    scores = quest.quest_page_scores(q, kmin, kmax, lengths)
    scale = shape.d ** -0.5
    out = quest.quest_attention(q, pool, rows, pages, lengths)
    baseline = torch_gather_attention(q, pool, rows, pages, lengths, scale)
    err = ((out.float() - baseline.float()).abs().max() / baseline.float().abs().max()).item()
    if not err < 2e-2:
        raise RuntimeError(f"triton and torch_gather disagree at batch={shape.batch} context={shape.context}:"
                           f" rel err {err:.3g}")

    def step():
        chosen = quest.quest_select(q, kmin, kmax, lengths, shape.k * PAGE)
        return quest.quest_attention(q, pool, quest.resident_rows(chosen, shape.n_pages), chosen, lengths)

    return {
        "triton": lambda: quest.quest_attention(q, pool, rows, pages, lengths),
        "torch_gather": lambda: torch_gather_attention(q, pool, rows, pages, lengths, scale),
        "triton_score": lambda: quest.quest_page_scores(q, kmin, kmax, lengths),
        "triton_select": lambda: quest.quest_select_pages(scores, lengths, shape.k * PAGE),
        "triton_step": step,
    }


def dense_mode(shape: Shape, device, dtype, gen) -> dict:
    n, hq, hkv, d = shape.batch, shape.hq, shape.hkv, shape.d
    k = torch.empty(n, hkv, shape.context, d, device=device, dtype=dtype).normal_(generator=gen)
    v = torch.empty_like(k).normal_(generator=gen)
    q = torch.randn(n, hq, d, device=device, dtype=dtype, generator=gen)
    return {"dense": lambda: quest.dense_attention(q, k, v)}


def run_shape(cfg: dict, batch: int, context: int, device, dtype, gen, cudagraph: bool = False) -> list[dict]:
    shape = Shape(cfg, batch, context, dtype)
    splits, _ = quest.split_plan(batch * shape.hkv, shape.k, device)
    base = {"bench": "attention", "family": "quest", "batch": batch, "context": context,
            "unit_bytes": shape.row_bytes, "heads": shape.hq, "kv_heads": shape.hkv, "head_dim": shape.d,
            "budget_tokens": shape.k * PAGE, "timer": timer_name(cudagraph)}
    rows = []
    for make in (sparse_modes, dense_mode):
        try:
            modes = make(shape, device, dtype, gen)
            for mode, fn in modes.items():
                try:
                    us, p20, p80 = time_us(fn, cudagraph)
                except torch.OutOfMemoryError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- e.g. a mode that cannot be captured: keep the others
                    print(f"  {mode} at batch={batch} context={context}: skipped, {type(exc).__name__}: "
                          f"{str(exc)[:300]}")
                    continue
                extra = {"mode": mode, "k": "" if mode == "dense" else shape.k,
                         "num_splits": splits if mode in ("triton", "triton_step") else ""}
                rows += metric_rows({**base, **extra}, us, p20, p80, *shape.work(mode))
        except torch.OutOfMemoryError:
            print(f"  {make.__name__} at batch={batch} context={context}: out of memory, skipped")
        finally:
            modes = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict]) -> None:
    by_mode: dict = {}
    for r in rows:
        by_mode.setdefault(r["mode"], {})[r["metric"]] = r["value"]
    gather_us = by_mode.get("torch_gather", {}).get("us", float("nan"))
    for mode, m in by_mode.items():
        r0 = next(r for r in rows if r["mode"] == mode)
        print(f"{r0['batch']:6d} {r0['context']:8d} {mode:14s} {m['us']:10.1f} {m['TFLOPs']:8.2f}/790"
              f" {m['GBps']:8.0f}/4300 {m['roofline_frac']:9.3f} {gather_us / m['us']:10.2f}")


def check_target(all_rows: list[dict]) -> None:
    """Print whether the Triton attention reaches TARGET_FRAC of its roofline at batch >= TARGET_BATCH."""
    fracs = [(r["batch"], r["context"], r["value"]) for r in all_rows
             if r["mode"] == "triton" and r["metric"] == "roofline_frac" and r["batch"] >= TARGET_BATCH]
    if not fracs:
        return
    worst = min(fracs, key=lambda f: f[2])
    verdict = "meets" if worst[2] >= TARGET_FRAC else "MISSES"
    print(f"target: triton roofline_frac >= {TARGET_FRAC} at batch >= {TARGET_BATCH}: {verdict}"
          f" (worst {worst[2]:.3f} at batch={worst[0]} context={worst[1]})")


def sweep(cfg: dict, device, dtype, out_dir: Path, cudagraph: bool = False) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"Quest decode: HQ={cfg['heads']} HKV={cfg['kv_heads']} D={cfg['head_dim']} budget={cfg['budget']}"
          f" tokens ({cfg['budget'] // PAGE} pages of {PAGE}) {dtype} on {name},"
          f" timer {timer_name(cudagraph)}")
    print(f"{'batch':>6s} {'context':>8s} {'mode':14s} {'us':>10s} {'TFLOP/s':>12s} {'GB/s':>13s}"
          f" {'roofline':>9s} {'vs gather':>10s}")
    all_rows = []
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            rows = run_shape(cfg, batch, context, device, dtype, gen, cudagraph)
            print_rows(rows)
            append_rows(out_dir / "attention.csv", rows)
            all_rows += rows
    check_target(all_rows)


def tune(cfg: dict, device, dtype) -> None:
    """Attention time over pages per step x splits x warps at batch 32 (or the largest quick batch) and
    the largest context, to choose the defaults (no CSV rows)."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = Shape(cfg, min(TARGET_BATCH, max(cfg["batches"])), max(cfg["contexts"]), dtype)
    x = sparse_inputs(shape, device, dtype, gen)
    attention_inputs = [x[key] for key in ("q", "kv", "rows", "pages", "lengths")]
    _, nbytes = shape.work("triton")
    print(f"tune at batch={shape.batch} context={shape.context}: pages/step, splits, warps, us, GB/s of 4300")
    for ppi in (1, 2, 4, 8):
        default = quest.split_plan(shape.batch * shape.hkv, shape.k, device, ppi)[0]
        for splits in sorted({1, 2, 4, 8, default}):
            if splits > triton.cdiv(shape.k, ppi):
                continue
            for warps in (4, 8):
                us, _, _ = time_us(lambda: quest.quest_attention(*attention_inputs, splits=splits,
                                                                 pages_per_iter=ppi, num_warps=warps))
                mark = "  (default)" if (ppi, splits, warps) == (2, default, 4) else ""
                print(f"  {ppi:3d} {splits:6d} {warps:5d} {us:10.1f} {nbytes / us * 1e-3:8.0f}{mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    parser.add_argument("--quick", action="store_true", help="tiny configuration (works on the CPU interpreter)")
    parser.add_argument("--tune", action="store_true", help="time attention configurations, write nothing")
    parser.add_argument("--cudagraph", action="store_true",
                        help="time CUDA graph replays, as the decode loop runs (no host launch overhead)")
    args = parser.parse_args()
    check_out_folder(parser, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.cudagraph:
        raise SystemExit("--cudagraph needs a CUDA GPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = QUICK if args.quick or device.type != "cuda" else FULL
    if args.tune:
        tune(cfg, device, dtype)
    else:
        sweep(cfg, device, dtype, args.out, args.cudagraph)


if __name__ == "__main__":
    main()
