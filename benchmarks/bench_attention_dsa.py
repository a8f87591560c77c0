"""DSA sparse MLA decode: the project's kernel beside a torch gather baseline and dense attention.

    python -m benchmarks.bench_attention_dsa [--out DIR] [--quick] [--tune] [--backend auto|triton|gluon]

Modes, in one run: `triton` (hisparse.dsa.ops.sparse_mla_decode over k selected rows of a resident pool;
its `kernel` column says which one ran: `gluon` on Hopper with Triton 3.6, else `triton`; --backend
picks one),
`torch_gather` (gather the selected rows, then matmul-softmax-matmul in torch) and `dense` (torch's
scaled_dot_product_attention over the whole context, the 128 heads as 128 queries of one MQA head).
Appends `us`, `TFLOPs`, `GBps` and `roofline_frac` rows (family `dsa`) to DIR/attention.csv.
The sparse modes count the work of the ideal kernel: each selected row read once (N*k*1152 bytes
plus q and out) and 2*N*H*k*(576+512) FLOPs; dense counts the whole context the same way. The
roofline is the binding one of HBM 4.3 TB/s and bf16 matrix 790 TFLOP/s.
`--tune` times the Triton kernel's configurations at one shape (no CSV rows), to choose the defaults,
and on a Hopper GPU the Gluon kernel (kernels_triton/dsa_gluon.py) at its tile shapes beside them.
`--tune --kv-dtype fp8` times the FP8 rows' kernel instead: tiles, warps, stages, its dequantisation
modes (hisparse.dsa.fp8.DEQUANT_MODES) and split counts, one line per compiled configuration as it is
timed (its best split count first), then the default's and the best's; roofline over the fp8 rows'
bytes, rel err against the float32 torch reference over the dequantised rows.
`--indexer` times the selection instead and appends to DIR/indexer.csv: lightning-indexer scores over
every resident indexer key (64 heads x 128 dims, `triton` with bf16 keys, `triton_fp8` with fp8 keys
and a per-token scale, `torch` an einsum in bf16) and the top-k (`topk`, hisparse.dsa.ops.topk_select).
`--kv-dtype fp8` times the FP8 rows' kernel (hisparse.dsa.fp8, 656-byte rows) as mode `triton`
(`kernel` triton_fp8), and where the Gluon FP8 kernel runs (Hopper, Triton 3.6:
`fp8.fp8_gluon_unsupported`) that one beside it as mode `gluon` (`kernel` gluon_fp8), each with its
roofline over those bytes; the baselines over the dequantised rows.
`--quick` runs a tiny configuration that also works on the CPU interpreter.
"""
from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    HBM_BYTES_PER_S,
    MMA_FLOPS_PER_S,
    metric_rows,
    print_table,
    time_us,
    timer_name,
)
from hisparse.dsa import fp8
from hisparse.dsa import ops as dsa
from hisparse.dsa import reference as dsa_ref
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder

D_QK, D_V = 576, 512
SM_SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2  # DeepSeek-V3.2: qk head dim 192, YaRN factor 40
FULL = dict(batches=(1, 2, 4, 8, 16, 32, 64, 128), contexts=(8192, 16384, 32768, 65536, 131072),
            heads=128, k=2048)
QUICK = dict(batches=(1, 3), contexts=(256,), heads=16, k=61)
INDEX_HEADS, INDEX_DIM = 64, 128


def torch_gather_decode(q, kv, rows, sm_scale):
    """The torch baseline: gather the selected rows, matmul, softmax (float32), matmul."""
    picked = kv[rows.clamp(min=0).long()]  # [N, k, D]
    logits = torch.bmm(q, picked.transpose(1, 2)).float() * sm_scale  # [N, H, k]
    logits.masked_fill_((rows < 0)[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return torch.bmm(probs.to(q.dtype), picked[..., :D_V])  # [N, H, D_V]


def dense_decode(q, kv_dense, sm_scale):
    """Dense absorbed-MLA decode over the whole context: one MQA head, the H heads as H queries."""
    keys = kv_dense[:, None]  # [N, 1, context, D]
    out = F.scaled_dot_product_attention(q[:, None], keys, keys[..., :D_V], scale=sm_scale)
    return out[:, 0]  # [N, H, D_V]


def work(batch: int, heads: int, keys: int, row_bytes: int = 2 * D_QK) -> tuple[float, float]:
    """(FLOPs, bytes) of an ideal decode of `heads` heads over `keys` rows per request (rows of
    `row_bytes`: bf16's 1152, or the FP8 row's 656), q and out in bf16, 4-byte row ids."""
    flops = 2.0 * batch * heads * keys * (D_QK + D_V)
    nbytes = batch * keys * row_bytes + 2.0 * batch * heads * (D_QK + D_V) + 4.0 * batch * keys
    return flops, nbytes


def make_inputs(batch, context, heads, k, device, gen):
    """Resident pool [batch*context, 576] bf16, q [batch, heads, 576], k distinct rows per request."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = torch.randn(batch * context, D_QK, device=device, dtype=dtype, generator=gen)
    q = torch.randn(batch, heads, D_QK, device=device, dtype=dtype, generator=gen)
    tokens = torch.rand(batch, context, device=device, generator=gen).topk(k, dim=1).indices  # random order
    rows = (tokens + torch.arange(batch, device=device)[:, None] * context).to(torch.int32)
    return q, kv, rows


def run_shape(batch, context, heads, k, device, gen, cudagraph: bool = False,
              backend: str = "auto", kv_dtype: str = "bf16") -> tuple[list[dict], dict]:
    """Time the three modes at one shape; returns result rows and {mode: us}. kv_dtype "fp8": the
    pool is FP8 rows (hisparse.dsa.fp8, 656 bytes each), `triton` their Triton kernel (and a fourth
    mode, `gluon`, their Gluon kernel where it runs), the baselines run
    over the dequantised rows (so they check the kernel, and count the bf16 rows they read).

    A mode that fails (out of memory, an unsupported backend, a kernel that disagrees with the
    baseline) is reported and skipped, so the other modes' rows are still recorded.
    """
    q, kv, rows = make_inputs(batch, context, heads, k, device, gen)
    if kv_dtype == "fp8":
        stored = fp8.to_rows(kv)                              # [R, 656] uint8
        kv = fp8.from_rows(stored, kv.dtype)                  # what the FP8 rows hold, for the baselines
        kernel = "triton_fp8"
        tiles = dsa.default_decode_config(heads, D_QK, q.dtype)
        triton_fn = lambda: fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="triton")[0]  # noqa: E731
    else:
        kernel = dsa.decode_backend(q, D_V, backend)
        tiles = dsa.GLUON_TILES if kernel == "gluon" else dsa.default_decode_config(heads, D_QK, q.dtype)
        triton_fn = lambda: dsa.sparse_mla_decode(q, kv, rows, SM_SCALE, backend=backend)[0]  # noqa: E731
    _, splits = dsa.split_plan(batch, heads, k, tiles, device)
    modes = {
        "triton": (triton_fn, k),
        "torch_gather": (lambda: torch_gather_decode(q, kv, rows, SM_SCALE), k),
        "dense": (lambda: dense_decode(q, kv.view(batch, context, D_QK), SM_SCALE), context),
    }
    gluon_splits = None
    if kv_dtype == "fp8" and fp8.fp8_gluon_unsupported(q, stored) is None:     # beside triton_fp8, on Hopper
        modes["gluon"] = (lambda: fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="gluon")[0], k)
        _, gluon_splits = dsa.split_plan(batch, heads, k, fp8.GLUON_FP8_TILES, device)
    kernels = {"triton": kernel, "gluon": "gluon_fp8"}
    mode_splits = {"triton": splits, "gluon": gluon_splits}
    rows_out, times, outputs = [], {}, {}
    for mode, (fn, keys) in modes.items():
        try:
            outputs[mode] = fn().float()
            us, p20, p80 = time_us(fn, cudagraph)
        except Exception as exc:  # noqa: BLE001 -- keep the other modes' rows
            print(f"  {mode:12s} batch={batch} context={context}: skipped, "
                  f"{type(exc).__name__}: {str(exc)[:300]}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        times[mode] = us
        fp8_rows = kv_dtype == "fp8" and mode in kernels
        row_bytes = fp8.ROW_BYTES if fp8_rows else D_QK * kv.element_size()
        flops, nbytes = work(batch, heads, keys, row_bytes)
        base = {"bench": "attention", "family": "dsa", "mode": mode, "batch": batch, "context": context,
                "k": k if mode != "dense" else "", "unit_bytes": row_bytes, "heads": heads,
                "num_splits": mode_splits.get(mode, ""), "us_p20": p20, "us_p80": p80,
                "kernel": kernels.get(mode, ""),
                "timer": timer_name(cudagraph)}
        if kv_dtype == "fp8":            # every mode of an fp8 run: its baselines read the same values
            base["kv_dtype"] = "fp8"
        rows_out += metric_rows(base, us, flops, nbytes)
    for mode in kernels:
        if {mode, "torch_gather"} <= times.keys():
            baseline = outputs["torch_gather"]
            err = ((outputs[mode] - baseline).abs().max() / baseline.abs().max()).item()
            if not err < 2e-2:
                print(f"  {mode} disagrees with torch_gather at batch={batch} context={context} (rel err {err:.3g}):"
                      " its rows are dropped")
                rows_out = [r for r in rows_out if r["mode"] != mode]
                del times[mode]
    return rows_out, times


def sweep(cfg: dict, device: torch.device, out_dir: Path, cudagraph: bool = False, backend: str = "auto",
          kv_dtype: str = "bf16") -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"DSA sparse MLA decode: heads={cfg['heads']} k={cfg['k']} D={D_QK} (V {D_V}) scale={SM_SCALE:.4f}"
          f" on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'},"
          f" timer {timer_name(cudagraph)}, decode backend {backend}, rows {kv_dtype}")
    print(f"{'batch':>6s} {'context':>8s} {'mode':13s} {'us':>10s} {'TFLOP/s':>12s} {'GB/s':>13s}"
          f" {'roofline':>9s} {'vs gather':>10s}")
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            try:
                rows, times = run_shape(batch, context, cfg["heads"], cfg["k"], device, gen, cudagraph, backend,
                                        kv_dtype)
            except torch.OutOfMemoryError:
                print(f"  batch={batch} context={context}: inputs do not fit in memory, skipped")
                torch.cuda.empty_cache()
                continue
            print_table(rows, times)
            append_rows(out_dir / "attention.csv", rows)
            if batch == 64 and cfg["k"] == 2048 and {"triton", "torch_gather"} <= times.keys():
                frac, kernel = next((r["value"], r["kernel"]) for r in rows
                                    if r["mode"] == "triton" and r["metric"] == "roofline_frac")
                speedup = times["torch_gather"] / times["triton"]
                if kv_dtype == "fp8":          # issue 36: goal 0.5 of the fp8 rows' roofline, bar bf16 Gluon's 0.41
                    for frac, kernel in ((r["value"], r["kernel"]) for r in rows
                                         if r["mode"] in ("triton", "gluon") and r["metric"] == "roofline_frac"):
                        print(f"  target (batch 64, k 2048, {kernel} kernel, fp8 rows): roofline_frac {frac:.3f} "
                              f"(goal >= 0.50: {frac >= 0.5}; bar >= 0.41: {frac >= 0.41})")
                else:
                    print(f"  target (batch 64, k 2048, {kernel} kernel): roofline_frac {frac:.3f} (>= 0.40:"
                          f" {frac >= 0.4}), {speedup:.2f}x torch_gather (>= 3: {speedup >= 3})")
        if device.type == "cuda":
            torch.cuda.empty_cache()


def tune(cfg: dict, device: torch.device, batch: int, cudagraph: bool = False) -> None:
    """Time the decode kernel over a grid of tile and launch shapes at one shape, best last; prints only."""
    gen = torch.Generator(device=device).manual_seed(0)
    heads, k = cfg["heads"], cfg["k"]
    q, kv, rows = make_inputs(batch, cfg["contexts"][0], heads, k, device, gen)
    ref = torch_gather_decode(q, kv, rows, SM_SCALE).float()
    flops, nbytes = work(batch, heads, k)
    roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
    results = []
    for bh, bk, warps, stages in itertools.product((32, 64), (16, 32, 64), (4, 8), (1, 2, 3)):
        config = dsa.DecodeConfig(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages)
        try:
            def call():
                return dsa.sparse_mla_decode(q, kv, rows, SM_SCALE, config=config, backend="triton")
            err = ((call()[0].float() - ref).abs().max() / ref.abs().max()).item()
            us = time_us(call, cudagraph)[0]
        except Exception as exc:  # a config that does not fit (shared memory, registers) is skipped
            print(f"  {config}: {type(exc).__name__}")
            continue
        results.append((us, config, err))
    results += tune_gluon(q, kv, rows, ref, cudagraph)
    print(f"tune at batch={batch} heads={heads} k={k}: roofline {roofline_us:.1f} us (default"
          f" {dsa.default_decode_config(heads, D_QK, q.dtype)})")
    for us, config, err in sorted(results, key=lambda r: -r[0]):
        print(f"  {us:10.1f} us  roofline_frac {roofline_us / us:.3f}  rel err {err:.1e}  {config}")


# --tune --kv-dtype fp8: (block_h, num_warps) pairs x block_k x num_stages x dequant modes, each at the
# split counts `splits` (None: split_plan's own); outer loops first, so a time budget that runs out
# drops the 3-stage configs first. 64 heads need 8 warps (one warp group's accumulator would be 256
# registers a thread), 16 heads need no more than 4; 16-32 heads at 4 warps run mma.sync and leave room
# for 2 programs an SM, where every wgmma tile (64 heads, 8 warps, 255 registers) runs one.
FP8_TUNE = {"heads_warps": ((32, 4), (64, 8), (16, 4), (32, 8)), "block_k": (64, 32, 16), "stages": (2, 1, 3),
            "dequant": fp8.DEQUANT_MODES, "splits": (None, 2, 4)}
FP8_TUNE_QUICK = {"heads_warps": ((16, 4),), "block_k": (16, 32), "stages": (1,), "dequant": fp8.DEQUANT_MODES,
                  "splits": (None, 2)}
FP8_TUNE_MAX_ERR = 2e-2     # as run_shape's check of the kernel against torch_gather


def tune_fp8(cfg: dict, device: torch.device, batch: int, cudagraph: bool = False, grid: dict = FP8_TUNE,
             budget_s: float = 480.0) -> list[tuple]:
    """Time the FP8 rows' decode kernel (hisparse.dsa.fp8) over `grid` at one shape; prints one line per
    configuration as it is timed, then the default's and the best's. A configuration that fails (too much
    shared memory, no registers left) prints its error and is skipped; none starts after `budget_s`
    seconds. Returns [(us, label, rel err)] of the timed grid configurations (the default's not among them)."""
    gen = torch.Generator(device=device).manual_seed(0)
    heads, k = cfg["heads"], cfg["k"]
    q, kv, rows = make_inputs(batch, cfg["contexts"][0], heads, k, device, gen)
    stored = fp8.to_rows(kv)                                              # [R, 656] uint8
    del kv
    ref = dsa_ref.sparse_mla_decode_fp8_ref(q, stored, rows, SM_SCALE)[0].float()
    ref_max = ref.abs().max()
    flops, nbytes = work(batch, heads, k, fp8.ROW_BYTES)
    roofline_us = max(flops / MMA_FLOPS_PER_S, nbytes / HBM_BYTES_PER_S) * 1e6
    default = fp8.default_fp8_decode_config(heads, q.dtype)
    print(f"tune fp8 rows at batch={batch} heads={heads} k={k}: roofline {roofline_us:.1f} us over "
          f"{fp8.ROW_BYTES}-byte rows; default {default}, dequant inline", flush=True)

    def timed(call) -> tuple[float, float]:
        err = ((call()[0].float() - ref).abs().max() / ref_max).item()
        return time_us(call, cudagraph)[0], err

    def line(us: float, err: float, label: str) -> str:
        flag = "" if err < FP8_TUNE_MAX_ERR else "  WRONG (rel err over 2e-2)"
        return f"  {us:10.1f} us  roofline_frac {roofline_us / us:.3f}  rel err {err:.1e}  {label}{flag}"

    default_us = float("nan")
    try:    # as the model calls the Triton kernel: no config, the launcher's own (shrunk if it does not fit)
        default_us, err = timed(lambda: fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, backend="triton"))
        _, splits = dsa.split_plan(batch, heads, k, default, device)
        print(line(default_us, err, f"default: {default}, inline, splits {splits}"), flush=True)
    except Exception as exc:  # noqa: BLE001 -- reported; the grid still runs
        print(f"  default: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}", flush=True)
    results = []
    combos = [(bh, warps, bk, stages, dequant)
              for stages in grid["stages"] for bk in grid["block_k"] for bh, warps in grid["heads_warps"]
              for dequant in grid["dequant"]]
    start = time.monotonic()
    for i, (bh, warps, bk, stages, dequant) in enumerate(combos):
        if time.monotonic() - start > budget_s:
            print(f"  time budget of {budget_s:.0f} s spent: {len(combos) - i} of {len(combos)} configurations "
                  f"not timed", flush=True)
            break
        config = dsa.DecodeConfig(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages)
        label = f"block_h {bh} block_k {bk} warps {warps} stages {stages} {dequant}"
        per_split, errs = {}, []
        try:
            for want in grid["splits"]:
                _, splits = dsa.split_plan(batch, heads, k, config, device, want)
                if splits in per_split:
                    continue

                def call(splits=splits, config=config, dequant=dequant):
                    return fp8.sparse_mla_decode_fp8(q, stored, rows, SM_SCALE, num_splits=splits, config=config,
                                                     dequant=dequant)
                per_split[splits], err = timed(call)
                errs.append(err)
        except Exception as exc:  # noqa: BLE001 -- a config that does not fit (shared memory, registers) is skipped
            message = " ".join(str(exc).split())
            print(f"  {label}: skipped, {type(exc).__name__}: {message[:160]}", flush=True)
            if "CUDA error" in message or "illegal" in message:   # the context is lost: nothing after it is timed
                print("  the CUDA context did not survive that error: the tune stops here", flush=True)
                break
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if not per_split:
                continue
        best = min(per_split, key=per_split.get)
        others = ", ".join(f"{n}: {t:.1f}" for n, t in per_split.items() if n != best)
        results.append((per_split[best], f"{label}, splits {best}" + (f" (other splits {others} us)" if others else ""),
                        max(errs)))
        print(line(per_split[best], max(errs), results[-1][1]), flush=True)
    good = [r for r in results if r[2] < FP8_TUNE_MAX_ERR]
    if good:
        best = min(good, key=lambda r: r[0])
        print(f"best of {len(good)}: {best[0]:.1f} us, roofline_frac {roofline_us / best[0]:.3f} "
              f"({default_us / best[0]:.2f}x the default's speed): {best[1]}", flush=True)
    return results


def tune_gluon(q, kv, rows, ref, cudagraph: bool) -> list[tuple]:
    """(us, label, rel err) of the Gluon kernel (kernels_triton/dsa_gluon.py: QK^T once per tile) at
    its tile and ring shapes, on a Hopper GPU with Triton's Gluon; none elsewhere."""
    if reason := dsa.gluon_decode_unsupported(q, D_V):
        print(f"  gluon: not timed ({reason})")
        return []
    results = []
    for block_k, stages in ((64, 2), (32, 3), (32, 4)):
        label = f"gluon(block_k={block_k}, num_stages={stages})"
        def call():
            return dsa.sparse_mla_decode_gluon(q, kv, rows, SM_SCALE, block_k=block_k, num_stages=stages)
        try:
            err = ((call()[0].float() - ref).abs().max() / ref.abs().max()).item()
            results.append((time_us(call, cudagraph)[0], label, err))
        except Exception as exc:  # noqa: BLE001 - a tile shape that fails (e.g. too much shared memory) is reported, not fatal
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:200]}")
    return results


def indexer_modes(batch: int, context: int, k: int, device: torch.device, gen) -> dict:
    """{mode: (fn, FLOPs, bytes)} of the selection step at one shape, every request at full length."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=device, generator=gen).to(dtype)
    weights = torch.randn(batch, INDEX_HEADS, device=device, generator=gen) * INDEX_HEADS ** -0.5
    keys = torch.randn(batch, context, INDEX_DIM, device=device, generator=gen).to(dtype)
    scale = torch.rand(batch, context, device=device, generator=gen) + 0.5
    keys8 = keys.to(dsa.FP8)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    scores = dsa.indexer_scores(q, weights, keys, lengths)
    flops = 2.0 * batch * INDEX_HEADS * context * INDEX_DIM
    key_bytes = batch * context * INDEX_DIM * keys.element_size() + 4.0 * batch * context  # + scores out

    def torch_scores():
        logits = torch.einsum("nhd,ntd->nht", q, keys).relu_()  # [N, H, T]
        return torch.einsum("nht,nh->nt", logits, weights.to(dtype)).float()

    return {
        "triton": (lambda: dsa.indexer_scores(q, weights, keys, lengths), flops, key_bytes),
        "triton_fp8": (lambda: dsa.indexer_scores(q, weights, keys8, lengths, key_scale=scale), flops,
                       batch * context * (INDEX_DIM + 8.0)),
        "torch": (torch_scores, flops, key_bytes),
        "topk": (lambda: dsa.topk_select(scores, lengths, k), 0.0, 4.0 * batch * context),
    }


def sweep_indexer(cfg: dict, device: torch.device, out_dir: Path) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"DSA selection: indexer {INDEX_HEADS} heads x {INDEX_DIM}, top-{cfg['k']}")
    print(f"{'batch':>6s} {'context':>8s} {'mode':11s} {'us':>10s} {'TFLOP/s':>12s} {'GB/s':>13s}"
          f" {'roofline':>9s}")
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            rows = []
            try:
                modes = indexer_modes(batch, context, cfg["k"], device, gen)
            except torch.OutOfMemoryError:
                print(f"  batch={batch} context={context}: inputs do not fit in memory, skipped")
                torch.cuda.empty_cache()
                continue
            for mode, (fn, flops, nbytes) in modes.items():
                try:
                    us = time_us(fn)[0]
                except Exception as exc:  # noqa: BLE001 -- keep the other modes' rows
                    print(f"  {mode:11s} batch={batch} context={context}: skipped, {type(exc).__name__}")
                    continue
                base = {"bench": "indexer", "family": "dsa", "mode": mode, "batch": batch, "context": context,
                        "k": cfg["k"], "heads": INDEX_HEADS}
                new = metric_rows(base, us, flops, nbytes)
                m = {r["metric"]: r["value"] for r in new}
                print(f"{batch:6d} {context:8d} {mode:11s} {us:10.1f} {m['TFLOPs']:8.1f}/790"
                      f" {m['GBps']:8.0f}/4300 {m['roofline_frac']:9.3f}")
                rows += new
            append_rows(out_dir / "indexer.csv", rows)
            del modes
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help=OUT_HELP)
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (CPU interpreter too)")
    parser.add_argument("--tune", action="store_true", help="time decode configurations instead of the sweep")
    parser.add_argument("--tune-batch", type=int, default=None,
                        help="batch of --tune (default 64; with --quick the quick shape's largest, 3)")
    parser.add_argument("--tune-budget-s", type=float, default=480.0,
                        help="--tune --kv-dtype fp8: start no configuration after this many seconds (default "
                             "%(default)s, so that the whole grid's run fits a 10-minute command)")
    parser.add_argument("--indexer", action="store_true", help="time indexer scores and top-k instead")
    parser.add_argument("--cudagraph", action="store_true",
                        help="time CUDA graph replays, as the decode loop runs (no host launch overhead)")
    parser.add_argument("--backend", choices=dsa.DECODE_BACKENDS, default="auto",
                        help="decode kernel of mode `triton` (default %(default)s: Gluon where it runs, else Triton)")
    parser.add_argument("--kv-dtype", choices=fp8.KV_DTYPES, default="bf16",
                        help="rows of the pool: bf16, or fp8 (656-byte FP8 rows read by the Triton FP8 kernel, and "
                             "on Hopper by the Gluon FP8 kernel beside it; rows marked kv_dtype=fp8, roofline over "
                             "their bytes) (default %(default)s)")
    args = parser.parse_args(argv)
    if args.kv_dtype == "fp8" and (args.backend == "gluon" or args.indexer):
        parser.error("--kv-dtype fp8 times the Triton FP8 kernel (in the sweep or with --tune; in the sweep on Hopper "
                     "the Gluon FP8 kernel beside it, as mode gluon): not with --backend gluon or --indexer")
    check_out_folder(parser, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        raise SystemExit("the full sweep needs a CUDA GPU; use --quick on the CPU")
    if device.type == "cpu" and args.cudagraph:
        raise SystemExit("--cudagraph needs a CUDA GPU")
    cfg = QUICK if args.quick else FULL
    if args.tune_batch is None:
        args.tune_batch = max(cfg["batches"]) if args.quick else 64
    if args.tune_batch < 1:
        parser.error(f"--tune-batch {args.tune_batch}: expected a positive integer")
    if args.backend == "gluon" and not args.indexer:
        probe = torch.empty(1, cfg["heads"], D_QK, device=device, dtype=torch.bfloat16 if device.type == "cuda"
                            else torch.float32)
        reason = dsa.gluon_decode_unsupported(probe, D_V)
        if reason:
            parser.error(f"--backend gluon: the Gluon decode kernel cannot run here: {reason}")
    if args.tune and args.kv_dtype == "fp8":
        tune_fp8(cfg, device, args.tune_batch, args.cudagraph, FP8_TUNE_QUICK if args.quick else FP8_TUNE,
                 args.tune_budget_s)
    elif args.tune:
        tune(cfg, device, args.tune_batch, args.cudagraph)
    elif args.indexer:
        sweep_indexer(cfg, device, args.out)
    else:
        sweep(cfg, device, args.out, args.cudagraph, args.backend, args.kv_dtype)


if __name__ == "__main__":
    main()
