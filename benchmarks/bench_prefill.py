"""Prefill time of one request, per family and prompt length, beside the FLOP roofline.

    python -m benchmarks.bench_prefill [--out DIR] [--family dsa quest nsa] [--contexts 4096 32768 131072]
    python -m benchmarks.bench_prefill --quick          # tiny models on the CPU (Triton's interpreter)

Each family's study model with random weights: DSA at the throughput study's geometry (61 layers,
128 heads, 512 + 64 latents, k = 2048, a 64 x 128 indexer; hidden 1024, dense MLPs), Quest at
Llama-3-8B's (32 layers, hidden 4096, 32 query and 8 KV heads of 128, MLP 14336), NSA at the NSA
paper's 27B attention (30 layers, hidden 2560, 64 query and 4 KV heads, compressed blocks 32 /
stride 16, 16 selected blocks of 64, window 512) with one head dim of 128 for keys and values (the
paper's keys are 192 wide, its values 128; our model has one head dim, and 192 would pad the
kernels' tiles to 256) and a dense MLP of 7168 standing in for its MoE. One prompt of
`context` random tokens goes through `model.prefill(..., fast=True)` (the kernels; `--reference`
also times the eager torch reference) in chunks of `--chunk-size` tokens into a resident state,
after a warm-up prefill that compiles the kernels. Rows (results/prefill.csv): `prefill_s`,
`tokens_per_s`, `peak_gib` (the GPU memory the prefill held above the weights, the request's KV
included), `kv_gib` (that KV) and `roofline_frac` (the prefill's matrix FLOPs over prefill_s at
the H200's measured bf16 rate; a DSA query attends min(k, its length) tokens, a Quest query its
causal prefix, an NSA query its compressed blocks, selected tokens and window). Printed beside the targets: DSA 32K <= 8 s, 128K <= 60 s, peak <= KV + 4 GiB;
Quest 32K >= 0.4 of the roofline.
"""
import argparse
import time

import torch

from benchmarks.common import MMA_FLOPS_PER_S
from hisparse.dsa import ops as dsa_ops
from hisparse.dsa.fp8_index import INDEX_DTYPES
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import randomize_
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder
from hisparse.runtime import nbytes

DSA = dict(model_type="deepseek_v32", vocab_size=1024, num_hidden_layers=61, first_k_dense_replace=61,
           hidden_size=1024, intermediate_size=2048, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536,
           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_topk=2048, index_head_dim=128,
           index_n_heads=64, moe_intermediate_size=256, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, n_group=1, topk_group=1)
QUEST = dict(model_type="llama", vocab_size=1024, num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, quest_dense_layers=2)
NSA = {"model_type": "nsa", "vocab_size": 1024, "num_hidden_layers": 30, "hidden_size": 2560,
       "intermediate_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128}
QUICK = {"dsa": dict(DSA, num_hidden_layers=2, first_k_dense_replace=2, hidden_size=64, intermediate_size=96,
                     num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24,
                     v_head_dim=20, index_topk=16, index_head_dim=32, index_n_heads=8),
         "quest": dict(QUEST, num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16),
         "nsa": dict(NSA, num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_selected_blocks=4, sliding_window=64)}
TARGETS = {("dsa", 32768): "prefill_s <= 8 (goal 4)", ("dsa", 131072): "prefill_s <= 60",
           ("quest", 32768): "roofline_frac >= 0.4"}


def nsa_keys_attended(cfg, context: int) -> float:
    """Keys the prompt's queries attend, summed over queries (lengths 1 .. context) and branches:
    the complete compressed blocks, the tokens of the selected blocks (all of them while a query
    has at most n blocks, else n - 1 full blocks and its newest, partial one), the window."""
    lengths = torch.arange(1, context + 1, dtype=torch.float64)
    size, stride, block = cfg.compress_block_size, cfg.compress_block_stride, cfg.selection_block_size
    compressed = torch.where(lengths >= size, torch.div(lengths - size, stride, rounding_mode="floor") + 1, 0)
    blocks = torch.ceil(lengths / block)
    n = cfg.num_selected_blocks
    selected = torch.where(blocks <= n, lengths, (n - 1) * block + lengths - block * (blocks - 1))
    return float((compressed + selected + lengths.clamp(max=cfg.sliding_window)).sum())


def prefill_flops(family: str, cfg, context: int) -> float:
    """Matrix FLOPs (2 per multiply-add) of one prompt's prefill: every projection and MLP, the
    attention each query does (DSA: over min(k, its length) latents, and the indexer over its
    length; Quest: its causal prefix; NSA: its three branches' keys and the compression of each
    block), the logits of the last token."""
    s, prefix = context, context * (context + 1) / 2            # tokens, and the sum of their lengths
    h = cfg.hidden_size
    if family == "dsa":
        heads, dc, dr, dn, dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                 cfg.qk_nope_head_dim, cfg.v_head_dim)
        k = cfg.index_topk
        selected = k * (k + 1) / 2 + (s - k) * k if s > k else prefix
        per_token = (h * cfg.q_lora_rank + cfg.q_lora_rank * heads * (dn + dr) + h * (dc + dr)
                     + heads * dn * dc + heads * dc * dv + heads * dv * h + 3 * h * cfg.intermediate_size
                     + cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim
                     + h * cfg.index_n_heads)
        attention = heads * (2 * dc + dr) * selected + cfg.index_n_heads * cfg.index_head_dim * prefix
    elif family == "nsa":
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        per_token = 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * heads + 3 * h * cfg.intermediate_size
        n_cmp = 0 if s < cfg.compress_block_size else (s - cfg.compress_block_size) // cfg.compress_block_stride + 1
        attention = 2 * heads * d * nsa_keys_attended(cfg, s) + 2 * kv_heads * d * d * n_cmp
    else:
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        per_token = 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * cfg.intermediate_size
        attention = 2 * heads * d * prefix
    return 2 * (cfg.num_hidden_layers * (s * per_token + attention) + h * cfg.vocab_size)


def build(family: str, quick: bool, device: torch.device) -> torch.nn.Module:
    raw = QUICK[family] if quick else {"dsa": DSA, "quest": QUEST, "nsa": NSA}[family]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = build_model(config_from_dict(dict(raw)))
    randomize_(model, seed=0, on_device=device.type == "cuda")
    return model.to(device=device, dtype=dtype)


def run_prefill(model, context: int, chunk: int, fast: bool, device: torch.device,
                index_dtype: str = "bf16") -> tuple[float, float, float]:
    """(seconds, peak GiB above what was allocated before, KV GiB) of one prompt of `context` tokens
    (index_dtype: how a DSA state stores its indexer keys)."""
    ids = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    state = model.new_state(1, context, **({"index_dtype": index_dtype} if index_dtype != "bf16" else {}))
    kv = sum(nbytes(*vars(layer).values()) for layer in state.layers)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() - kv          # the weights: the state counts as the prefill's
    start = time.perf_counter()
    model.prefill(ids, state, chunk, fast=fast, last_logits=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else float("nan")
    del state
    return seconds, peak, kv / 2**30


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    ap.add_argument("--family", nargs="+", choices=("dsa", "quest", "nsa"), default=["dsa", "quest", "nsa"])
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="prompt tokens (default 4096 32768 131072; --quick: 40 100)")
    ap.add_argument("--chunk-size", type=int, default=4096, help="prompt tokens per prefill chunk (default 4096)")
    ap.add_argument("--reference", action="store_true",
                    help="also time the eager torch reference (slow: 102.5 s for DSA at 32K on the H200)")
    ap.add_argument("--reference-chunk-size", type=int, default=512,
                    help="the reference's chunk (default 512: its dense [heads, chunk, T] scores grow with it)")
    ap.add_argument("--index-dtype", choices=INDEX_DTYPES, default="bf16",
                    help="how DSA stores its indexer keys (default bf16; fp8: DeepSeek-V3.2's e4m3 keys and scales)")
    ap.add_argument("--topk", choices=dsa_ops.TOPK_METHODS, default=dsa_ops.PREFILL_TOPK,
                    help=f"DSA's prefill top-k (default {dsa_ops.PREFILL_TOPK}; radix: kernels_triton/topk.py)")
    ap.add_argument("--quick", action="store_true", help="tiny models on the CPU, through Triton's interpreter")
    args = ap.parse_args(argv)
    check_out_folder(ap, args.out)
    for flag, value, default in (("--index-dtype", args.index_dtype, "bf16"),
                                 ("--topk", args.topk, dsa_ops.PREFILL_TOPK)):
        if value != default and args.family != ["dsa"]:
            ap.error(f"{flag} {value}: DSA's prefill only; pass --family dsa")
    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        ap.error("the full-size run needs a CUDA GPU; --quick runs tiny models on the CPU")
    contexts = args.contexts or ([40, 100] if args.quick else [4096, 32768, 131072])
    bad = [n for n in contexts + [args.chunk_size, args.reference_chunk_size] if n < 1]
    if bad:
        ap.error(f"--contexts, --chunk-size and --reference-chunk-size must be positive, got {bad[0]}")
    chunk = min(args.chunk_size, 16) if args.quick else args.chunk_size
    device = torch.device("cuda" if gpu else "cpu")
    print(f"{'family':>6} {'mode':>9} {'context':>8} | {'prefill s':>9} {'tokens/s':>9} {'peak GiB':>8} "
          f"{'KV GiB':>7} {'roofline':>8} | target", flush=True)
    previous, dsa_ops.PREFILL_TOPK = dsa_ops.PREFILL_TOPK, args.topk     # the switch DSA's prefill reads
    try:
        measure(args, contexts, chunk, device, gpu)
    finally:
        dsa_ops.PREFILL_TOPK = previous


def measure(args, contexts: list[int], chunk: int, device: torch.device, gpu: bool) -> None:
    """Each family's prefill at each context (and the reference's, with --reference): rows and a line each."""
    for family in args.family:
        model = build(family, args.quick, device)
        cfg = model.config
        run_prefill(model, min(contexts[0], 2 * chunk), chunk, True, device, args.index_dtype)   # compiles
        modes = ["model", "reference"] if args.reference else ["model"]
        for context in contexts:
            for mode in modes:
                size = chunk if mode == "model" else min(args.reference_chunk_size, chunk)
                seconds, peak, kv = run_prefill(model, context, size, mode == "model", device, args.index_dtype)
                flops = prefill_flops(family, cfg, context)
                frac = flops / seconds / MMA_FLOPS_PER_S if gpu else float("nan")
                k = cfg.index_topk if family == "dsa" else cfg.num_selected_blocks if family == "nsa" else ""
                base = dict(bench="prefill", family=family, mode=mode, batch=1, context=context, k=k,
                            chunk_size=size, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                            **({"index_dtype": args.index_dtype} if family == "dsa" else {}),
                            **({"topk": args.topk} if family == "dsa" and mode == "model" else {}))
                metrics = {"prefill_s": (seconds, "s"), "tokens_per_s": (context / seconds, "tokens/s"),
                           "peak_gib": (peak, "GiB"), "kv_gib": (kv, "GiB"), "roofline_frac": (frac, "fraction")}
                append_rows(f"{args.out}/prefill.csv",
                            [dict(base, metric=m, value=v, unit=u) for m, (v, u) in metrics.items()])
                target = TARGETS.get((family, context), "") if mode == "model" else ""
                if family == "dsa" and mode == "model" and gpu:
                    target += f"{'; ' if target else ''}peak <= KV + 4 = {kv + 4:.1f} GiB"
                print(f"{family:>6} {mode:>9} {context:8d} | {seconds:9.2f} {context / seconds:9.0f} {peak:8.2f} "
                      f"{kv:7.2f} {frac:8.3f} | {target}", flush=True)
        del model
        if gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
