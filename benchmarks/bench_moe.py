"""One MoE layer of the study model at decode batches, timed against its weight reads at the HBM's line rate.

    python -m benchmarks.bench_moe [--out DIR] [--batches 1,2,4,8,16,32,64] [--experts 9]
                                   [--intermediate 2896] [--per-token 2] [--hidden 7168]
    python -m benchmarks.bench_moe --quick        # a tiny layer on the CPU (wall clock)

The layer is `dsa_v32_ep8`'s (experiments/study_model.py: hidden 7168, 9 routed experts of intermediate
2896, 2 a token, one shared expert of the same size, bf16); `--experts 32 --intermediate 2048
--per-token 8` gives one EP8 GPU's share of a DeepSeek-V3.2 layer. Each row is the router, the routed
experts and the shared expert on `batch` tokens, in one of three ways:
- `graph_batched`: `Experts.every_expert` (what a CUDA-graph step runs), replayed from a graph;
- `graph_loop`: the per-expert loop it replaced (`loop_every_expert`, below), replayed from a graph;
- `eager_sparse`: `Experts.forward` outside a graph (a host sync picks the experts the tokens reach).
`GBps` counts the weights each way reads (every routed expert in a graph; those reached, eagerly),
`roofline_frac` = (bytes / 4.8 TB/s, the H200's nominal HBM rate) / time: 1 is line rate.
"""
import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import HBM_BYTES_PER_S, time_us, timer_name
from hisparse.models.config import config_from_dict
from hisparse.models.tiny import TINY_CONFIGS
from hisparse.models.moe import Experts, MoE
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder

HBM_NOMINAL_BYTES_PER_S = 4.8e12      # the H200's HBM3e, nominal (common.HBM_BYTES_PER_S is the measured copy rate)
MODES = ("graph_batched", "graph_loop", "eager_sparse")
# the study model's MoE (experiments/study_model.py, which benchmarks do not import): hidden 7168, experts
# of 2896 (scaled with the hidden size), 2 of 9 a token, one shared expert
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE, STUDY_HIDDEN = 9, 2, 2896, 7168


def loop_every_expert(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The graphed path before it was batched: every expert on every token, one expert's GEMMs at a
    time, added in x's dtype in ascending expert order (the baseline rows; tests compare against it)."""
    out = torch.zeros_like(x)
    for expert in range(experts.gate_up_proj.shape[0]):
        routed = (weights * (ids == expert)).sum(dim=-1)                        # [N], 0 if not routed
        gate, up = F.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
        out += (F.linear(F.silu(gate) * up, experts.down_proj[expert]) * routed[:, None]).to(out.dtype)
    return out


def moe_layer(moe: MoE, x: torch.Tensor, routed_experts) -> torch.Tensor:
    """MoE.forward on x [N, H] with the routed experts computed by routed_experts(experts, x, ids, weights)."""
    weights, ids = moe.gate(x)
    return routed_experts(moe.experts, x, ids, weights) + moe.shared_experts(x)


def weight_bytes(moe: MoE, routed_reached: int | None = None) -> int:
    """Bytes of weights one call reads: router, shared expert, and all routed experts (None) or that many."""
    size = lambda t: t.numel() * t.element_size()
    experts = moe.experts.gate_up_proj.shape[0]
    routed = size(moe.experts.gate_up_proj) + size(moe.experts.down_proj)
    reached = experts if routed_reached is None else routed_reached
    rest = sum(size(t) for t in (*moe.gate.parameters(), *moe.gate.buffers(), *moe.shared_experts.parameters()))
    return rest + routed * reached // experts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    ap.add_argument("--batches", default=None, help="decode batches, comma-separated (default 1,2,4,8,16,32,64; --quick 1,3)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 7168; --quick 64)")
    ap.add_argument("--experts", type=int, default=EXPERTS, help=f"routed experts (default {EXPERTS})")
    ap.add_argument("--intermediate", type=int, default=None,
                    help=f"an expert's intermediate size (default {EXPERT_INTERMEDIATE}, scaled with --hidden)")
    ap.add_argument("--per-token", type=int, default=EXPERTS_PER_TOKEN,
                    help=f"experts a token picks (default {EXPERTS_PER_TOKEN})")
    ap.add_argument("--quick", action="store_true", help="a tiny layer on the CPU")
    args = ap.parse_args(argv)
    check_out_folder(ap, args.out)
    gpu = torch.cuda.is_available() and not args.quick
    if not gpu and not args.quick:
        ap.error("the full-size run needs a CUDA GPU; --quick runs a tiny layer on the CPU")
    try:
        batches = [int(b) for b in (args.batches or ("1,3" if args.quick else "1,2,4,8,16,32,64")).split(",")]
    except ValueError:
        ap.error(f"--batches {args.batches!r}: expected comma-separated positive integers, e.g. 1,2,4")
    hidden = args.hidden or (64 if args.quick else 7168)
    if min(batches) < 1 or hidden < 1 or args.experts < 1 or (args.intermediate or 1) < 1:
        ap.error(f"--batches, --hidden, --experts and --intermediate must be positive, got "
                 f"{batches}, {hidden}, {args.experts}, {args.intermediate}")
    if not 1 <= args.per_token <= args.experts:
        ap.error(f"--per-token {args.per_token}: expected 1 to --experts ({args.experts})")
    config = dict(TINY_CONFIGS["deepseek_v32"], hidden_size=hidden, n_routed_experts=args.experts,
                  num_experts_per_tok=args.per_token, n_shared_experts=1, n_group=1, topk_group=1,
                  moe_intermediate_size=args.intermediate or max(1, round(EXPERT_INTERMEDIATE * hidden / STUDY_HIDDEN)))
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    moe = MoE(config_from_dict(config)).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
        moe.gate.e_score_correction_bias.zero_()

    cfg = moe.experts.gate_up_proj.shape
    gpu_name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"{gpu_name}: MoE layer, hidden {hidden}, {cfg[0]} experts of intermediate {cfg[1] // 2}, "
          f"{args.per_token} a token, {dtype}; times beside weight bytes / {HBM_NOMINAL_BYTES_PER_S / 1e12:.1f} TB/s "
          f"(measured copy rate {HBM_BYTES_PER_S / 1e12:.2f} TB/s)")
    print(f"{'batch':>6} {'mode':14s} {'us':>9} {'GB read':>8} {'line-rate us':>12} {'GB/s':>7} {'roofline':>8}")
    rows = []
    with torch.no_grad():
        for batch in batches:
            x = torch.randn(batch, hidden, device=device, dtype=dtype)
            reached = int(moe.gate(x)[1].unique().numel())
            batched = moe_layer(moe, x, Experts.every_expert)
            loop = moe_layer(moe, x, loop_every_expert)
            diff = float((batched.float() - loop.float()).abs().max())
            ways = {"graph_batched": (lambda: moe_layer(moe, x, Experts.every_expert), True, None),
                    "graph_loop": (lambda: moe_layer(moe, x, loop_every_expert), True, None),
                    "eager_sparse": (lambda: moe_layer(moe, x, Experts.forward), False, reached)}
            for mode, (fn, graphed, reach) in ways.items():
                us = time_us(fn, cudagraph=graphed and gpu)[0]
                nbytes = weight_bytes(moe, reach)
                line_us = nbytes / HBM_NOMINAL_BYTES_PER_S * 1e6
                base = dict(bench="moe", mode=mode, batch=batch, hidden=hidden, experts=cfg[0],
                            intermediate=cfg[1] // 2, per_token=args.per_token, experts_reached=reach or cfg[0],
                            dtype=str(dtype).removeprefix("torch."), timer=timer_name(graphed))
                metrics = {"us": (us, "us"), "GBps": (nbytes / us / 1e3, "GB/s"), "weight_GB": (nbytes / 1e9, "GB"),
                           "roofline_frac": (line_us / us, "fraction")}
                rows += [dict(base, metric=m, value=v, unit=u) for m, (v, u) in metrics.items()]
                print(f"{batch:6d} {mode:14s} {us:9.1f} {nbytes / 1e9:8.3f} {line_us:12.1f} "
                      f"{nbytes / us / 1e3:7.0f} {line_us / us:8.3f}")
            print(f"{'':6s} batched - loop: max |difference| {diff:.3g} (float summation order over experts)")
    append_rows(f"{args.out}/moe.csv", rows)


if __name__ == "__main__":
    main()
