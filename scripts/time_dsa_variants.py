"""Time the DSA sparse MLA decode variants (kernels_triton/dsa_variants.py) beside the default kernel
(hisparse.dsa.sparse_mla_decode) and the torch gather baseline, on one CUDA GPU, in well under 90 s:

    python -m scripts.time_dsa_variants [--batches 64 32 128] [--only SUBSTRING ...] [--calls 10]

128 heads, D 512 + 64 bf16, k 2048 distinct random rows per request from a pool of 32K rows per request
(each request's own region). Each mode is captured in a CUDA graph of `--calls` back-to-back calls and
replayed; one line per mode and batch: us per call, the fraction of the compute roofline
(2*N*128*k*(576+512) FLOP at 790 TFLOP/s: 46 us at batch 64), the speed-up over torch_gather and
max |out - default out|. A mode that fails (out of shared memory, does not compile) is printed and skipped.
"""
import argparse
import time

import torch

HEADS, D_V, D_ROPE, K_SEL, POOL = 128, 512, 64, 2048, 32768
SM_SCALE = 576 ** -0.5
MMA_FLOPS_PER_S = 790e12

# name -> mla_decode_fused keyword arguments. Offline under Triton 3.6 (scripts/sass_dsa_variants.py):
# registers, KiB of shared memory, CTAs per SM; none spills. The default: 243 regs, 212 KiB, 1 CTA/SM.
FUSED = {
    # 242 regs, 108 KiB, 2 CTA/SM: all tile loads asynchronous (s2: some plain loads)
    "fused h64 k16 v2 w4 s3": dict(block_h=64, block_k=16, v_split=2, num_warps=4, num_stages=3, ctas_per_sm=2),
    "fused h64 k16 v2 w4 s2": dict(block_h=64, block_k=16, v_split=2, num_warps=4, num_stages=2, ctas_per_sm=2),
    # 255 regs, 144 KiB, 1 CTA/SM
    "fused h64 k32 v2 w4 s3": dict(block_h=64, block_k=32, v_split=2, num_warps=4, num_stages=3, ctas_per_sm=1),
    # 162 / 207 regs, 144 / 216 KiB, 1 CTA/SM; QK^T on both warp groups (HGMMA 74 / 76)
    "fused h64 k32 v2 w8 s2": dict(block_h=64, block_k=32, v_split=2, num_warps=8, num_stages=2, ctas_per_sm=1),
    "fused h64 k64 v2 w8 s2": dict(block_h=64, block_k=64, v_split=2, num_warps=8, num_stages=2, ctas_per_sm=1),
    # 188 / 196 / 215 regs, 180 / 180 / 216 KiB, 1 CTA/SM: one warp group per 64 heads, no duplicated QK^T
    "fused h128 k16 v2 w8 s2": dict(block_h=128, block_k=16, v_split=2, num_warps=8, num_stages=2, ctas_per_sm=1),
    "fused h128 k16 v2 w8 s3": dict(block_h=128, block_k=16, v_split=2, num_warps=8, num_stages=3, ctas_per_sm=1),
    "fused h128 k32 v2 w8 s2": dict(block_h=128, block_k=32, v_split=2, num_warps=8, num_stages=2, ctas_per_sm=1),
    # 248 / 248 / 255 regs, 144 / 108 / 216 KiB, 1 CTA/SM: chained dots, QK^T on both warp groups
    "fused h64 k32 v1 w8 s3": dict(block_h=64, block_k=32, v_split=1, num_warps=8, num_stages=3, ctas_per_sm=1),
    "fused h64 k16 v1 w8 s3": dict(block_h=64, block_k=16, v_split=1, num_warps=8, num_stages=3, ctas_per_sm=1),
    "fused h64 k64 v1 w8 s2": dict(block_h=64, block_k=64, v_split=1, num_warps=8, num_stages=2, ctas_per_sm=1),
    # 255 regs, 55 KiB, 2 CTA/SM: mma.sync (no wgmma below 64 heads)
    "fused h32 k16 v1 w4 s3": dict(block_h=32, block_k=16, v_split=1, num_warps=4, num_stages=3, ctas_per_sm=2),
}


def torch_gather_decode(q, kv, rows, row_base, sm_scale):
    """The torch baseline of benchmarks/bench_attention_dsa.py: gather, matmul, softmax (float32), matmul."""
    picked = kv[(row_base[:, None] + rows.clamp(min=0)).long()]  # [N, k, D]
    logits = torch.bmm(q, picked.transpose(1, 2)).float() * sm_scale  # [N, H, k]
    logits.masked_fill_((rows < 0)[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    return torch.bmm(probs.to(q.dtype), picked[..., :D_V])


def graph_us(fn, calls: int, replays: int = 10) -> float:
    """us per call of `fn`, `calls` calls captured in one CUDA graph, replayed `replays` times."""
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (replays * calls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 32, 128])
    ap.add_argument("--only", nargs="*", default=None, help="time only the modes whose name holds one of these")
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph (default %(default)s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    from hisparse import dsa
    from kernels_triton import dsa_variants as dv

    t0 = time.time()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton "
          f"{__import__('triton').__version__}; {HEADS} heads, k {K_SEL}, pool {POOL} rows per request")
    gen = torch.Generator(device=device).manual_seed(0)
    max_batch = max(args.batches)
    kv = torch.randn(max_batch * POOL, D_V + D_ROPE, device=device, dtype=torch.bfloat16, generator=gen)
    for batch in args.batches:
        q = torch.randn(batch, HEADS, D_V + D_ROPE, device=device, dtype=torch.bfloat16, generator=gen)
        rows = torch.rand(batch, POOL, device=device, generator=gen).topk(K_SEL, dim=1).indices.to(torch.int32)
        row_base = torch.arange(batch, device=device, dtype=torch.int64) * POOL
        roofline_us = 2.0 * batch * HEADS * K_SEL * (D_V + D_ROPE + D_V) / MMA_FLOPS_PER_S * 1e6
        modes = {
            "default": lambda: dsa.sparse_mla_decode(q, kv, rows, SM_SCALE, row_base=row_base)[0],
            "torch_gather": lambda: torch_gather_decode(q, kv, rows, row_base, SM_SCALE),
        }
        for name, kw in FUSED.items():
            modes[name] = (lambda kw: lambda: dv.mla_decode_fused(q, kv, rows, row_base, SM_SCALE, D_V, **kw))(kw)
        if args.only:
            modes = {n: f for n, f in modes.items() if n in ("default", "torch_gather") or
                     any(s in n for s in args.only)}
        print(f"batch {batch}: compute roofline {roofline_us:.1f} us")
        ref, gather_us = None, None
        for name, fn in modes.items():
            try:
                out = fn().float()
                torch.cuda.synchronize()
                us = graph_us(fn, args.calls)
            except Exception as exc:  # noqa: BLE001 - report, go on with the next mode
                print(f"  {name:26s} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                continue
            ref = out if ref is None else ref
            gather_us = us if name == "torch_gather" else gather_us
            vs = f"{gather_us / us:5.2f}x gather" if gather_us else ""
            print(f"  {name:26s} {us:8.1f} us  {roofline_us / us:5.3f} of roofline  {vs}  "
                  f"max|diff| vs default {(out - ref).abs().max().item():.3g}  [{time.time() - t0:.0f} s]",
                  flush=True)
            del out
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
