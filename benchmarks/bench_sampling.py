"""What sampling adds to a decode step: the sampler (temperature and top_p on) against the greedy argmax,
beside the graphed decode step of DSA at its real KV geometry.

    python -m benchmarks.bench_sampling [--out DIR] [--batch 64] [--context 4096] [--vocab 129280]
    python -m benchmarks.bench_sampling --quick          # a tiny model on the CPU (Triton's interpreter)

The model is bench_prefill's DSA (61 layers, 128 heads, 512 + 64 latents, k = 2048, hidden 1024) with
DeepSeek-V3.2's vocabulary (129280 ids: the sampler's cost grows with it). `step_ms`: the median
graphed decode step of `Engine.generate` (resident, random prefill, `--batch` requests of
`--context` tokens; its argmax included). `argmax_ms` and `sample_ms`: the greedy argmax and
`LaneSampling.sample` (its own CUDA graph; temperature 0.8, top_p 0.95 on every lane, no bias or
penalty: the sampler's fused pass skips their loads) plus its count update, over logits [batch, vocab]. `overhead_frac` = (sample_ms - argmax_ms) / step_ms, printed
beside the target: at most 0.02 on the H200 at batch 64.
"""
import argparse
import statistics
import time

import torch

from benchmarks.bench_prefill import DSA, QUICK
from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import randomize_
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder
from hisparse.sampling import LaneSampling, SamplingParams

TARGET = 0.02                   # sampling's share of a greedy step, at most
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=1)


def time_ms(fn, repeats: int, cuda: bool) -> float:
    """Median milliseconds of fn() (CUDA events around each call on a GPU, the host clock on a CPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    ap.add_argument("--batch", type=int, default=None, help="requests decoded together (default 64; --quick 3)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens a request (default 4096; --quick 40)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 129280; --quick 1024)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 50; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU, through Triton's interpreter")
    args = ap.parse_args(argv)
    check_out_folder(ap, args.out)
    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        ap.error("the full-size run needs a CUDA GPU; --quick runs a tiny model on the CPU")
    batch = args.batch or (3 if args.quick else 64)
    context = args.context or (40 if args.quick else 4096)
    vocab = args.vocab or (1024 if args.quick else 129280)
    steps = args.steps or (3 if args.quick else 50)
    if min(batch, context, vocab, steps) < 1:
        ap.error(f"--batch, --context, --vocab and --steps must be positive, got {(batch, context, vocab, steps)}")
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    model = build_model(config_from_dict(dict(QUICK["dsa"] if args.quick else DSA, vocab_size=vocab)))
    model = model.to(device=device, dtype=dtype)
    randomize_(model, 0)
    prompts = [torch.randint(0, vocab, (context,)) for _ in range(batch)]
    run = Engine(model, "resident", prefill="random").generate(prompts, steps + 3, graph=gpu, keep_logits=False,
                                                                warmup_steps=2)
    step_ms = statistics.median(run.step_ms)

    logits = (torch.randn(batch, vocab, device=device) * 3).to(dtype)
    sampler = LaneSampling(batch, vocab, device, graph=gpu)
    for lane in range(batch):
        sampler.set_lane(lane, SAMPLED)
    lanes = torch.ones(batch, dtype=torch.bool, device=device)
    repeats = 50 if gpu else 3
    argmax_ms = time_ms(lambda: logits.argmax(-1), repeats, gpu)
    sample_ms = time_ms(lambda: sampler.advance(sampler.sample(logits), lanes), repeats, gpu)
    overhead = (sample_ms - argmax_ms) / step_ms
    gpu_name = torch.cuda.get_device_name() if gpu else "cpu"
    base = dict(bench="sampling", family="dsa", mode="resident", batch=batch, context=context, k=model.config.index_topk,
                vocab=vocab, layers=model.config.num_hidden_layers, hidden=model.config.hidden_size,
                temperature=SAMPLED.temperature, top_p=SAMPLED.top_p, graph=gpu)
    metrics = {"step_ms": (step_ms, "ms"), "argmax_ms": (argmax_ms, "ms"), "sample_ms": (sample_ms, "ms"),
               "overhead_frac": (overhead, "fraction")}
    append_rows(f"{args.out}/sampling.csv", [dict(base, metric=m, value=v, unit=u) for m, (v, u) in metrics.items()])
    print(f"{gpu_name}: DSA decode step {step_ms:.3f} ms at batch {batch}, context {context}, vocab {vocab}; "
          f"argmax {argmax_ms:.3f} ms, sampler {sample_ms:.3f} ms: sampling adds {overhead:.2%} of a step "
          f"(target <= {TARGET:.0%} on the H200 at batch 64)")


if __name__ == "__main__":
    main()
