"""DSA's FP8 indexer keys (hisparse/dsa/fp8_index.py) against the bf16 ones: accuracy and speed.

    python -m benchmarks.bench_indexer_fp8 --model tiny           # CPU (interpreter): the tiny checkpoint
    python -m benchmarks.bench_indexer_fp8 --quick                # the tiny checkpoint, 1 x 12 tokens, 1 step
    python -m benchmarks.bench_indexer_fp8 [--model dsa]         # GPU: the study model's indexer, then the speed

Accuracy, measured on one run's own states (teacher-forced: the bf16-indexer run decodes, and at
every anchor layer and step both indexers score the same query over the same keys, the FP8 side over
the keys quantised): the top-k agreement (the fraction of the k picks both make) per layer, averaged
over steps and requests, for the FP8 kernels and for the torch reference (`fp8_scores_ref`, an
independent path: plain torch, no kernel). The prefill indexer's agreement the same way: the bf16
prefill's queries and keys at every anchor layer, each query row (causal, rows longer than k) picked
by the prefill kernel from bf16 keys and from FP8 keys, beside the decode kernel's agreement on the
same rows. Then the decode logits, teacher-forced too: from the bf16 run's state, one decode step
with every layer on the bf16 keys' selections but one anchor layer on the FP8 keys' (over the same
state's keys quantised), max |difference| over max |logit| against the all-bf16 step, the worst
layer, beside LOGIT_TOLERANCE: what one layer's FP8 picks change, not two free runs drifting apart.
Speed (GPU): the decode indexer at batch 64 over 128K keys, bf16 keys against FP8 keys (the query's
quantisation included, and the kernel alone at a few key tiles), in GB/s beside the HBM's 4.3 TB/s,
and FP8's speed-up beside the 1.6x target. Bytes moved there: bf16 keys 64 x 128K x 256 B = 2.15 GB,
FP8 keys 64 x 128K x 132 B = 1.11 GB (values 1.07 GB, scales 34 MB), the float32 scores 34 MB either
way: at 3 TB/s about 0.73 ms and 0.38 ms, a 1.9x bound on the speed-up.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import HBM_BYTES_PER_S, time_us
from hisparse.results import DEFAULT_OUT, OUT_HELP, append_rows, check_out_folder
from hisparse.dsa import fp8_index
from hisparse.dsa.ops import indexer_scores, topk_select
from hisparse.dsa.runtime import KernelDsaAttention

AGREEMENT_TARGET = 0.98      # the issue's: mean over layers of the FP8 picks shared with bf16's
SPEEDUP_TARGET = 1.6         # the issue's: FP8 decode indexer over bf16, batch 64, 128K
# decode logits, one layer's selections from FP8 keys against all from bf16 keys (teacher-forced),
# max |difference| / max |logit|, the worst layer. Not a bound FP8 can promise (a pick swapped near the
# k-th place changes an attention output), the level above which one layer's FP8 picks make another
# model: printed for the study model
LOGIT_TOLERANCE = 0.05


class AgreementAttention(KernelDsaAttention):
    """The resident kernel decode step, its selections the bf16 indexer's, recording at each anchor
    layer the FP8 indexer's agreement with them: kernels' and the torch reference's."""

    def __init__(self, record: bool = True):
        super().__init__("resident")
        self.record = record
        self.fp8_layer: int | None = None       # the one layer that attends over the FP8 keys' picks
        self.kernel: dict[int, list[float]] = {}
        self.reference: dict[int, list[float]] = {}

    def select(self, layer_idx, index_q, index_weights, kv, lengths, topk, scale):
        w = index_weights * scale
        bf16 = topk_select(indexer_scores(index_q, w, kv.index_keys, lengths), lengths, topk)
        if not self.record and layer_idx != self.fp8_layer:
            return bf16
        values, scales = fp8_index.quantize_keys(kv.index_keys)
        fp8 = fp8_index.select_stored(index_q, w, values, lengths, topk, scales)
        if not self.record:
            return fp8
        ref = topk_select(fp8_index.indexer_scores_fp8_ref(index_q, w, values, scales, lengths), lengths, topk)
        self.kernel.setdefault(layer_idx, []).extend(agreement(bf16, fp8, lengths, topk))
        self.reference.setdefault(layer_idx, []).extend(agreement(bf16, ref, lengths, topk))
        return bf16


def agreement(a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor, k: int) -> list[float]:
    """Per request: the fraction of its min(k, length) picks (selections [N, k], -1 padding) in both."""
    out = []
    for row_a, row_b, n in zip(a.tolist(), b.tolist(), lengths.tolist()):
        picks = min(k, n)
        out.append(len({x for x in row_a if x >= 0} & {x for x in row_b if x >= 0}) / max(picks, 1))
    return out


def measure_agreement(model, prompts: list[torch.Tensor], steps: int) -> tuple[dict, dict]:
    """({layer: mean agreement}, the same by the torch reference) over `steps` decode steps of the
    bf16-indexer run of `prompts` (equal lengths), every anchor layer."""
    device = model.model.embed_tokens.weight.device
    batch = torch.stack(prompts).to(device)
    state = model.new_state(len(prompts), batch.shape[1] + steps + 1)
    saved, model.sparse_attention = model.sparse_attention, AgreementAttention()
    try:
        with torch.no_grad():
            logits = model.prefill(batch, state, chunk_size=4096, fast=True, last_logits=True)[:, 0]
        for _ in range(steps):
            logits = model.decode(logits.argmax(-1), state)
        record = model.sparse_attention
    finally:
        model.sparse_attention = saved
    mean = lambda d: {layer: sum(v) / len(v) for layer, v in sorted(d.items())}   # noqa: E731
    return mean(record.kernel), mean(record.reference)


def measure_prefill_agreement(model, prompts: list[torch.Tensor]) -> dict[int, tuple[float, float]]:
    """{layer: (prefill agreement, decode agreement)}: the bf16 prefill's indexer queries and keys at
    every anchor layer (prompts of equal length), each query row s (causal length s + 1, only rows
    longer than k) picked from bf16 keys and from the same keys quantised, by the prefill kernel
    (`prefill_select_stored`) and by the decode kernel (`select_stored`, one row a query)."""
    captured = {}
    for i, layer in enumerate(model.model.layers):
        indexer = layer.self_attn.indexer
        if indexer is not None:
            def project(*args, project=indexer.project, i=i, indexer=indexer):
                q, k, w = project(*args)
                captured[i] = q, k, w * indexer.softmax_scale, indexer.topk
                return q, k, w
            indexer.project = project           # an instance attribute over the method, deleted below
    batch = torch.stack(prompts).to(model.model.embed_tokens.weight.device)
    try:
        with torch.no_grad():
            model.prefill(batch, model.new_state(len(prompts), batch.shape[1]), fast=True, last_logits=True)
    finally:
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                del layer.self_attn.indexer.project
    out = {}
    for i, (q, k, w, topk) in sorted(captured.items()):
        prefill, decode = [], []
        for qs, ks, ws in zip(q, k, w):
            s = qs.shape[0]
            lengths = torch.arange(1, s + 1, device=qs.device)
            values, scales = fp8_index.quantize_keys(ks)
            expand = lambda t: t[None].expand(s, *t.shape)                              # noqa: E731
            pairs = [(prefill, fp8_index.prefill_select_stored(qs, ws, ks, 0, topk),
                      fp8_index.prefill_select_stored(qs, ws, values, 0, topk, scales)),
                     (decode, fp8_index.select_stored(qs, ws, expand(ks), lengths, topk),
                      fp8_index.select_stored(qs, ws, expand(values), lengths, topk, expand(scales)))]
            for into, bf16, fp8 in pairs:
                into.extend(agreement(bf16[topk:], fp8[topk:], lengths[topk:], topk))
        out[i] = sum(prefill) / max(len(prefill), 1), sum(decode) / max(len(decode), 1)
    return out


def logits_difference(model, prompts: list[torch.Tensor], steps: int) -> float:
    """Teacher-forced: over `steps` decode steps of the bf16-indexer run of `prompts` (equal lengths),
    each step run again once per anchor layer with that layer's selection from the FP8 keys (the
    state's keys quantised), the others from the bf16 keys; max |logits - the all-bf16 step's| /
    max |logit|, the worst layer and step. A step run again rewrites the rows it reads first (every
    layer writes its token before attending), so only the lengths are put back."""
    device = model.model.embed_tokens.weight.device
    batch = torch.stack(prompts).to(device)
    state = model.new_state(len(prompts), batch.shape[1] + steps + 1)
    saved, model.sparse_attention = model.sparse_attention, AgreementAttention(record=False)
    anchors = [i for i, kind in enumerate(model.config.indexer_types) if kind == "full"]
    worst = 0.0
    try:
        with torch.no_grad():
            logits = model.prefill(batch, state, chunk_size=4096, fast=True, last_logits=True)[:, 0]
            for _ in range(steps):
                tokens, lengths, max_length = logits.argmax(-1), state.lengths.clone(), state.max_length
                for layer in anchors:
                    model.sparse_attention.fp8_layer = layer
                    swapped = model.decode(tokens, state)
                    state.lengths.copy_(lengths)
                    state.max_length = max_length
                    model.sparse_attention.fp8_layer = None
                    logits = model.decode(tokens, state)          # last: the bf16 step the run goes on from
                    worst = max(worst, ((swapped - logits).abs().max() / logits.abs().max()).item())
                    if layer != anchors[-1]:
                        state.lengths.copy_(lengths)
                        state.max_length = max_length
    finally:
        model.sparse_attention = saved
    return worst


def speed(batch: int = 64, context: int = 131072, heads: int = 64, dim: int = 128) -> dict:
    """Decode indexer times (us) and GB/s at batch x context, bf16 keys against FP8 keys (GPU)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, dim, device="cuda", generator=gen).bfloat16()
    w = torch.rand(batch, heads, device="cuda", generator=gen) * heads ** -0.5
    keys = torch.randn(batch, context, dim, device="cuda", generator=gen).bfloat16()
    values, scales = fp8_index.quantize_keys(keys)
    lengths = torch.full((batch,), context, device="cuda", dtype=torch.int64)
    q8, w8 = fp8_index.quantize_query(q, w)
    out = {"bf16": time_us(lambda: indexer_scores(q, w, keys, lengths))[0],
           "fp8": time_us(lambda: fp8_index.indexer_scores_fp8(q, w, values, scales, lengths))[0],
           "fp8_kernel": time_us(lambda: indexer_scores(q8, w8, values, lengths, key_scale=scales))[0],
           "fp8_upcast_kernel": time_us(lambda: indexer_scores(q8, w8, values, lengths, key_scale=scales,
                                                               fp8_dot=False))[0]}
    for block_t in (64, 256):                                  # the default is 128: other key tiles
        out[f"fp8_kernel_t{block_t}"] = time_us(lambda: indexer_scores(q8, w8, values, lengths, key_scale=scales,
                                                                       block_t=block_t))[0]
    fp8_bytes = values.numel() + scales.numel() * 4                     # 132 B a key
    scores = batch * context * 4                                        # the float32 scores written
    for name, us in out.items():
        moved = (keys.numel() * 2 if name == "bf16" else fp8_bytes) + scores
        print(f"  {name:18s} {us:9.1f} us  {moved / us / 1e3:7.0f} GB/s, {moved / 1e9:.2f} GB "
              f"(HBM {HBM_BYTES_PER_S / 1e9:.0f} GB/s: {moved / HBM_BYTES_PER_S * 1e6:.0f} us)")
    print(f"  FP8 over bf16: {out['bf16'] / out['fp8']:.2f}x with the query's quantisation, "
          f"{out['bf16'] / out['fp8_kernel']:.2f}x the kernel alone (target >= {SPEEDUP_TARGET}x)")
    return out


def build_model(name: str, device: torch.device, layers: int):
    if name == "tiny":
        import tempfile

        from hisparse.models.loading import load_model
        from hisparse.models.tiny import write_tiny_checkpoint
        path = write_tiny_checkpoint("deepseek_v32", tempfile.mkdtemp(), seed=3)
        return load_model(path, dtype=torch.float32, device=device)
    # the study model's attention and indexer (DeepSeek-V3.2's: 128 heads, 64 indexer heads of 128, k = 2048)
    # at its hidden size 7168, small MLPs (they do not take part in the indexer), random weights as the sweep's
    from benchmarks.bench_prefill import DSA
    from hisparse.models.config import config_from_dict
    from hisparse.models.loading import build_model as build
    from hisparse.models.tiny import randomize_
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    raw = dict(DSA, num_hidden_layers=layers, first_k_dense_replace=layers, hidden_size=7168)
    with torch.device(device):
        model = build(config_from_dict(raw)).to(dtype)
    randomize_(model, seed=0, on_device=device.type == "cuda")
    return model


def report(agree: dict, ref: dict) -> float:
    for layer, value in agree.items():
        print(f"  layer {layer:3d}: {value:.4f} shared (torch reference {ref[layer]:.4f})")
    mean = sum(agree.values()) / len(agree)
    print(f"  mean over {len(agree)} layers {mean:.4f}, worst {min(agree.values()):.4f} "
          f"(target mean >= {AGREEMENT_TARGET})")
    return mean


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "dsa"), default=None,
                    help="tiny (CPU or GPU) or dsa (the study model's attention and indexer at hidden 7168, GPU); "
                         "default dsa on a GPU (as gpu_suite.sh runs it), else tiny")
    ap.add_argument("--layers", type=int, default=4, help="layers of the dsa model (default 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 40 tiny, 8192 study)")
    ap.add_argument("--batch", type=int, default=2, help="prompts (default 2)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 4 tiny, 16 study)")
    ap.add_argument("--no-speed", action="store_true", help="skip the GPU speed comparison")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny checkpoint, 1 prompt of 12 tokens, 1 step, no speed (seconds on the CPU)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP + " (indexer_fp8.csv)")
    args = ap.parse_args(argv)
    check_out_folder(ap, args.out)
    if args.quick:
        if args.model not in (None, "tiny"):
            ap.error("--quick runs the tiny checkpoint")
        args.prompt_len, args.steps, args.batch, args.no_speed = 12, 1, 1, True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model is None:
        args.model = "dsa" if device.type == "cuda" and not args.quick else "tiny"
    tiny = args.model == "tiny"
    length, steps = args.prompt_len or (40 if tiny else 8192), args.steps or (4 if tiny else 16)
    model = build_model(args.model, device, args.layers)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (length,), generator=gen) for _ in range(args.batch)]
    print(f"top-k agreement, FP8 vs bf16 indexer keys: {args.model}, {args.batch} x {length} tokens, {steps} steps, "
          f"k = {model.config.index_topk}")
    agree, ref = measure_agreement(model, prompts, steps)
    report(agree, ref)
    base = dict(bench="indexer_fp8", model=args.model, layers=model.config.num_hidden_layers, batch=args.batch,
                context=length, k=model.config.index_topk, new_tokens=steps)
    rows = [dict(base, metric="decode_agreement", value=sum(agree.values()) / len(agree), unit="fraction"),
            dict(base, metric="decode_agreement_worst", value=min(agree.values()), unit="fraction"),
            dict(base, metric="decode_agreement_reference", value=sum(ref.values()) / len(ref), unit="fraction")]
    print("prefill indexer, the same agreement per query row (rows longer than k):")
    prefill_agree = measure_prefill_agreement(model, prompts)
    for layer, (prefill, decode) in prefill_agree.items():
        print(f"  layer {layer:3d}: prefill kernel {prefill:.4f} shared, decode kernel on the same rows {decode:.4f}")
    if prefill_agree:
        rows.append(dict(base, metric="prefill_agreement", unit="fraction",
                         value=sum(p for p, _ in prefill_agree.values()) / len(prefill_agree)))
    diff = logits_difference(model, prompts, min(steps, 2))
    print(f"decode logits, one layer's picks from FP8 keys (teacher-forced, worst layer): max |diff| / "
          f"max |logit| = {diff:.4f} (tolerance {LOGIT_TOLERANCE})")
    rows.append(dict(base, metric="logit_rel_diff_worst_layer", value=diff, unit="fraction"))
    if device.type == "cuda" and not args.no_speed:
        print("decode indexer, batch 64, 128K keys:")
        times = speed()
        at = dict(base, batch=64, context=131072, new_tokens=None)
        rows += [dict(at, metric=f"decode_indexer_us_{name}", value=us, unit="us") for name, us in times.items()]
        rows.append(dict(at, metric="fp8_speedup", value=times["bf16"] / times["fp8"], unit="x"))
    append_rows(f"{args.out}/indexer_fp8.csv", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
