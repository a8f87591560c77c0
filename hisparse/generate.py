"""Generation (greedy, or sampled with --temperature and the options beside it) from a checkpoint through the decode engine, with timing, miss rate and KV memory.

    python -m hisparse.make_tiny --family deepseek_v32 --out /tmp/tiny
    python -m hisparse.generate --model /tmp/tiny --prompt-len 24 --new-tokens 8 --batch 2 \\
        --mode hisparse --cache-slots 16
    python -m hisparse.generate --model /tmp/tiny --prompt "The cache" --temperature 0.7 --stop "."
    python -m hisparse.make_tiny --family llama --out /tmp/tiny-llama
    python -m hisparse.generate --model /tmp/tiny-llama --prompt-lens 60,30 --new-tokens 8 \\
        --mode hisparse --token-budget 48 --cache-slots 6
    python -m hisparse.make_tiny --family nsa --out /tmp/tiny-nsa
    python -m hisparse.generate --model /tmp/tiny-nsa --prompt-len 1200 --new-tokens 4 \\
        --mode hisparse --cache-slots 16

Prints the configuration, each request's prompt and generated token ids (and text, with a tokenizer), tokens/s (batch x timed decode
steps / decode time), the time per output token, the miss rate (hisparse and noio modes) and the
bytes of KV state per request on the device that holds it (the GPU, or the CPU without one); progress
lines with the seconds elapsed go to stderr. Without a GPU the Triton kernels run through Triton's
interpreter (slow: use tiny checkpoints and short prompts).

Every family runs: DSA (model_type deepseek_v32, glm_moe_dsa: k = index_topk tokens per (request,
layer)), Quest (llama, qwen3: k = token_budget // 16 pages per (request, layer, KV head)) and NSA
(nsa: k = num_selected_blocks 64-token blocks per (request, layer, KV head)). The cache holds
B >= k units per stream. --kv-dtype fp8 (DSA) stores the MLA rows as DeepSeek-V3.2's 656-byte FP8
rows; it needs MLA's 512 + 64 latent geometry (a checkpoint from
`hisparse.models.tiny.write_tiny_checkpoint("deepseek_v32", DIR, kv_lora_rank=512,
qk_rope_head_dim=64, index_head_dim=64)` on a CPU). --index-dtype fp8 (DSA) stores the indexer keys
as DeepSeek-V3.2's FP8 keys (e4m3 and a float32 scale a token: 132 bytes at head dim 128).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from hisparse.dsa.fp8 import KV_DTYPES
from hisparse.dsa.fp8_index import INDEX_DTYPES
from hisparse.engine import Engine, family_runtime
from hisparse.models.loading import load_model
from hisparse.progress import Progress
from hisparse.quest.ops import PAGE
from hisparse.runtime import KV_MODES
from hisparse.sampling import MAX_LOGPROBS, SamplingParams
from hisparse.text import TextStream, load_tokenizer

FAMILIES = {"deepseek_v32": "DSA", "glm_moe_dsa": "DSA", "llama": "Quest", "qwen3": "Quest", "nsa": "NSA"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PROMPT_LEN = 32


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _int_list(text: str, what: str) -> list[int]:
    values = []
    for part in text.split(","):
        try:
            values.append(int(part.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {part.strip()!r} in {text!r} is not an integer") from None
    return values


def _prompt_ids(text: str) -> list[list[int]]:
    prompts = [_int_list(part, "token id") for part in text.split(";")]
    negative = [t for p in prompts for t in p if t < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"token id {negative[0]} in {text!r} is negative")
    return prompts


SEED_MAX = 2**64 - 1            # torch.Generator seeds are 64-bit


def _top_k(text: str) -> int:
    """--top-k: an int; -1 (vLLM's "every token", as the HTTP endpoint takes it) is 0."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer (0 or -1: every token), got {text!r}") from None
    return 0 if k == -1 else k


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**64 - 1 = {SEED_MAX}, got {text!r}")
    return value


def _prompt_lens(text: str) -> list[int]:
    lengths = _int_list(text, "length")
    bad = [n for n in lengths if n < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"prompt length {bad[0]} in {text!r} must be >= 1")
    return lengths


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hisparse.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, metavar="DIR",
                    help="checkpoint directory: config.json plus *.safetensors (Hugging Face layout), "
                         "e.g. one written by `python -m hisparse.make_tiny`")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-len", type=positive_int, metavar="N",
                        help=f"random prompts of N token ids each, drawn with --seed; each request gets its "
                             f"own (default {DEFAULT_PROMPT_LEN} when no prompt option is given)")
    prompt.add_argument("--prompt-lens", type=_prompt_lens, metavar="A,B,...",
                        help="random prompts of these lengths, one request per length (sets the batch)")
    prompt.add_argument("--prompt-ids", type=_prompt_ids, metavar="IDS",
                        help="explicit prompt token ids, comma-separated, e.g. '1,2,3'; one prompt is "
                             "repeated for every request of --batch; several prompts separated by ';' "
                             "('1,2,3;4,5') give one request each")
    prompt.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a text prompt, one request each (repeatable; the checkpoint needs a tokenizer, as "
                             "`python -m hisparse.make_tiny` writes); the generated tokens are printed as text too")
    ap.add_argument("--new-tokens", type=positive_int, default=16, metavar="N",
                    help="tokens generated per request, the first from the prefill's logits (default 16); "
                         "timing needs N >= 3 (the first decode step compiles and, with --graph, precedes the capture)")
    ap.add_argument("--batch", type=positive_int, default=None, metavar="N",
                    help="number of requests decoded together (default 1, or the number of --prompt-lens / "
                         "';'-separated --prompt-ids)")
    ap.add_argument("--mode", choices=KV_MODES, default="resident",
                    help="where the selectable KV units live (DSA's MLA latents, Quest's pages, NSA's selection "
                         "blocks): resident (all on the GPU, the baseline), hisparse (host pool + --cache-slots GPU "
                         "slots per stream, exact), noio (hisparse without the copies: wrong outputs, the time's "
                         "upper bound) (default resident)")
    ap.add_argument("--cache-slots", type=positive_int, default=None, metavar="B",
                    help="GPU slots per stream ((request, layer) for DSA, (request, layer, KV head) for Quest and "
                         "NSA); required for hisparse and noio, at least the model's selection size k (DSA: "
                         "index_topk tokens; Quest: token_budget // 16 pages; NSA: num_selected_blocks blocks); "
                         "ignored in resident mode")
    ap.add_argument("--token-budget", type=positive_int, default=None, metavar="T",
                    help="Quest checkpoints (llama, qwen3) only: tokens each KV head reads per decode step, "
                         f"k = T // {PAGE} pages, the current page included (at least {PAGE}; "
                         "default 4096, the model's)")
    ap.add_argument("--prefetch", action="store_true",
                    help="hisparse mode, checkpoints whose layers share selections (glm_moe_dsa's shared indexer "
                         "layers, quest_selection_group or NSA's selection_group > 1): copy the shared layers' rows "
                         "on a side stream while the layers in between compute (on a GPU; in line on a CPU)")
    ap.add_argument("--graph", action="store_true",
                    help="capture the whole decode step in a CUDA graph and replay it (needs a CUDA GPU)")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                    help="DSA checkpoints: how each MLA latent row is stored: bf16 (its 576 values in --dtype) or "
                         "fp8 (DeepSeek-V3.2's 656-byte rows: 512 e4m3, 4 scales, 64 bf16 RoPE; needs kv_lora_rank "
                         "512 and qk_rope_head_dim 64; decoded by the Gluon FP8 kernel on Hopper, Triton's "
                         "elsewhere) (default bf16)")
    ap.add_argument("--index-dtype", choices=INDEX_DTYPES, default="bf16",
                    help="DSA checkpoints: how each indexer key is stored: bf16 (in --dtype) or fp8 (DeepSeek-V3.2's "
                         "e4m3 key and float32 scale a token, 132 bytes at head dim 128, scored with an e4m3 query; "
                         "FP8 tensor-core products on sm_89+) (default bf16)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="weight and KV dtype (default bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--device", default=None,
                    help="torch device, e.g. cuda or cuda:1 (default cuda when a GPU is present, else cpu through "
                         "the Triton interpreter; on a GPU machine run with CUDA_VISIBLE_DEVICES= for that)")
    ap.add_argument("--chunk-size", type=positive_int, default=None, metavar="N",
                    help="prefill long prompts in chunks of N tokens (default: the whole prompt at once)")
    ap.add_argument("--prefill", choices=("model", "reference"), default="model",
                    help="model: through the family's kernels (default); "
                         "reference: the eager torch prefill")
    ap.add_argument("--max-context", type=positive_int, default=None, metavar="N",
                    help="KV capacity per request in tokens (default: longest prompt + new tokens)")
    ap.add_argument("--seed", type=_seed, default=0,
                    help="seed of the random prompts and of sampling (request b samples with seed + b, mod 2**63), "
                         "from 0 to 2**64 - 1 (default 0)")
    sample = ap.add_argument_group("sampling and stops (OpenAI's meanings; every request the same)")
    sample.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy, the logits' argmax (default); T > 0: sample from softmax(logits / T)")
    sample.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="keep the most likely tokens whose probabilities reach P, in (0, 1] (default 1: all)")
    sample.add_argument("--top-k", type=_top_k, default=0, metavar="K",
                        help="keep the K most likely tokens (default 0 or -1, as vLLM's: all)")
    sample.add_argument("--min-p", type=float, default=0.0, metavar="P",
                        help="keep tokens at least P times as likely as the most likely one, in [0, 1] (default 0)")
    sample.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                        help="subtract X in [-2, 2] from the logit of each token generated before (default 0)")
    sample.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                        help="subtract X in [-2, 2] per time a token was generated before (default 0)")
    sample.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help=f"print each generated token's log-probability (the raw logits' log-softmax) and the "
                             f"N most likely tokens', N in 0..{MAX_LOGPROBS}")
    sample.add_argument("--stop-token-ids", type=lambda text: tuple(_int_list(text, "token id")), default=(),
                        metavar="A,B,...", help="end a request at any of these token ids (kept as its last token)")
    sample.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end a request's text where this string begins (repeatable; needs a tokenizer; the "
                             "stop is left out, as OpenAI's stop)")
    sample.add_argument("--ignore-eos", action="store_true",
                        help="do not end a request at the checkpoint's eos_token_id (config.json)")
    sample.add_argument("--min-tokens", type=int, default=0, metavar="N",
                        help="no stop (eos or --stop-token-ids) before a request's N-th token (default 0)")
    ap.add_argument("--show-tokens", type=positive_int, default=32, metavar="N",
                    help="print at most N prompt ids and N generated ids per request (default 32)")
    return ap


def parse_device(ap: argparse.ArgumentParser, text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        ap.error(f"argument --device: unknown device {text!r}; expected e.g. cuda, cuda:0 or cpu")
    if device.type not in ("cuda", "cpu"):
        ap.error(f"argument --device: {text!r} is neither a CUDA device nor the CPU")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            ap.error(f"argument --device: {text!r} needs a CUDA GPU and none is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            ap.error(f"argument --device: {text!r} does not exist ({torch.cuda.device_count()} GPUs)")
    return device


def _prompts(ap, args, vocab: int, tokenizer) -> list[torch.Tensor]:
    if args.prompt is not None:
        if args.batch not in (None, len(args.prompt)):
            ap.error(f"argument --batch: {args.batch} differs from the {len(args.prompt)} prompts of --prompt")
        try:
            ids = [tokenizer.encode(text) for text in args.prompt]
        except ValueError as e:
            ap.error(f"argument --prompt: {e}")
        if any(not p for p in ids):
            ap.error("argument --prompt: a prompt encodes to no tokens")
        return [torch.tensor(p, dtype=torch.int64) for p in ids]
    if args.prompt_ids is not None:
        ids = args.prompt_ids
        if len(ids) > 1 and args.batch not in (None, len(ids)):
            ap.error(f"argument --batch: {args.batch} differs from the {len(ids)} prompts of --prompt-ids")
        if any(len(p) == 0 for p in ids):
            ap.error("argument --prompt-ids: a prompt is empty")
        if len(ids) == 1:
            ids = ids * (args.batch or 1)
        bad = [t for p in ids for t in p if t >= vocab]
        if bad:
            ap.error(f"argument --prompt-ids: token id {bad[0]} is out of range: the vocabulary has {vocab} ids")
        return [torch.tensor(p, dtype=torch.int64) for p in ids]
    if args.prompt_lens is not None:
        lengths = args.prompt_lens
        if args.batch not in (None, len(lengths)):
            ap.error(f"argument --batch: {args.batch} differs from the {len(lengths)} lengths of --prompt-lens")
    else:
        lengths = [args.prompt_len or DEFAULT_PROMPT_LEN] * (args.batch or 1)
    gen = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def _fmt_tokens(tokens: list[int], show: int) -> str:
    if len(tokens) <= show:
        return " ".join(map(str, tokens))
    return " ".join(map(str, tokens[:show])) + f" ... (+{len(tokens) - show} more)"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f} MiB ({nbytes:,.0f} bytes)"


def checkpoint_error(ap: argparse.ArgumentParser, message: str):
    """Exit 2 with argparse's error line alone: the arguments parsed, the --model folder's content is at
    fault, so the usage would not help."""
    ap.exit(2, f"{ap.prog}: error: {message}\n")


def load_checkpoint(ap: argparse.ArgumentParser, path: str, dtype: torch.dtype, device: torch.device,
                    progress: Progress | None = None):
    """The checkpoint's model; its warnings (config.json keys HiSparse does not read) printed as such first,
    a bad checkpoint (a bad config value or weight included) an error line (`checkpoint_error`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model, error = load_model(path, dtype=dtype, device=device, progress=progress), None
        except (ValueError, OSError) as e:
            model, error = None, e
    for w in caught:
        print(f"{ap.prog}: warning: {w.message}", file=sys.stderr)
    if error is not None:
        checkpoint_error(ap, f"argument --model: cannot load checkpoint {path!r}: {error}")
    return model


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    progress = Progress()
    device = parse_device(ap, args.device)
    if args.graph:
        if not torch.cuda.is_available():
            ap.error("argument --graph: CUDA graphs need a CUDA GPU and none is available")
        if device.type != "cuda":
            ap.error(f"argument --graph: CUDA graphs need a CUDA device, got --device {args.device}")
    if args.prefetch and args.mode != "hisparse":
        ap.error(f"argument --prefetch: applies to --mode hisparse, got --mode {args.mode}")
    if "" in args.stop:
        ap.error("argument --stop: an empty string is not a stop string (it would end every text at once)")
    if args.min_tokens > args.new_tokens:
        ap.error(f"argument --min-tokens: {args.min_tokens} is over --new-tokens {args.new_tokens}: a request ends "
                 f"at --new-tokens, so at most that")
    if device.type == "cpu" and torch.cuda.is_available():
        ap.error("argument --device: cpu runs the kernels in Triton's interpreter, which a process that sees a "
                 "GPU does not use: run with CUDA_VISIBLE_DEVICES= instead")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]

    config_path = Path(args.model) / "config.json"
    if not config_path.is_file():
        checkpoint_error(ap, f"argument --model: no config.json in checkpoint directory {args.model!r}")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        checkpoint_error(ap, f"argument --model: cannot read {config_path}: {e}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        checkpoint_error(ap, f"argument --model: checkpoint {args.model!r} has model_type {model_type!r}; the engine "
                             f"runs {', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    if args.token_budget is not None:
        if family != "Quest":
            ap.error(f"argument --token-budget: applies to Quest checkpoints (llama, qwen3), not model_type "
                     f"{model_type!r}")
        if args.token_budget < PAGE:
            ap.error(f"argument --token-budget: {args.token_budget} is under one page ({PAGE} tokens)")
    if args.kv_dtype != "bf16" and family != "DSA":
        ap.error(f"argument --kv-dtype: {args.kv_dtype} rows are DSA's (deepseek_v32, glm_moe_dsa), not model_type "
                 f"{model_type!r}'s ({family} keeps its KV in --dtype: --kv-dtype bf16)")
    if args.index_dtype != "bf16" and family != "DSA":
        ap.error(f"argument --index-dtype: {args.index_dtype} keys are DSA's indexer's (deepseek_v32, glm_moe_dsa), "
                 f"not model_type {model_type!r}'s")

    progress(f"loading {args.model} ({str(dtype).removeprefix('torch.')}, {device})")
    model = load_checkpoint(ap, args.model, dtype, device, progress)
    cfg = model.config
    try:
        runtime = family_runtime(model, args.token_budget, kv_dtype=args.kv_dtype, index_dtype=args.index_dtype)
    except ValueError as e:
        option = "--kv-dtype" if args.kv_dtype != "bf16" and "kv_dtype" in str(e) else "--model"
        ap.error(f"argument {option}: checkpoint {args.model!r} does not fit the {family} kernels: {e}")
    k = runtime.selection_size
    if args.prefetch and not runtime.shared_layers:
        ap.error(f"argument --prefetch: replays an anchor's miss plan in shared layers; checkpoint "
                 f"{args.model!r} ({model_type}) has none (glm_moe_dsa's indexer_types 'shared', or "
                 f"quest_selection_group / NSA's selection_group > 1, make them)")
    if args.mode != "resident" and args.cache_slots is None:
        ap.error(f"argument --mode: {args.mode} needs --cache-slots B with B >= k = {k} ({runtime.selection_name})")
    tokenizer = load_tokenizer(args.model) if args.prompt is not None or args.stop else None
    if tokenizer is None and (args.prompt is not None or args.stop):
        ap.error(f"argument --{'prompt' if args.prompt is not None else 'stop'}: checkpoint {args.model!r} has no "
                 f"tokenizer (tokenizer.json): give token ids (--prompt-ids) and --stop-token-ids instead")
    prompts = _prompts(ap, args, cfg.vocab_size, tokenizer)
    longest = max(len(p) for p in prompts)
    if args.max_context is not None and longest + args.new_tokens - 1 > args.max_context:
        ap.error(f"argument --max-context: {args.max_context} is too small for a prompt of {longest} tokens "
                 f"plus {args.new_tokens} new ones (needs >= {longest + args.new_tokens - 1})")
    try:
        engine = Engine(model, args.mode, cache_slots=args.cache_slots if args.mode != "resident" else None,
                        max_context=args.max_context, chunk_size=args.chunk_size, prefetch=args.prefetch,
                        token_budget=args.token_budget, prefill=args.prefill, kv_dtype=args.kv_dtype,
                        index_dtype=args.index_dtype)
    except ValueError as e:
        ap.error(f"argument --cache-slots: {e}")

    interp = " (Triton interpreter)" if device.type == "cpu" else ""
    capacity = args.max_context or longest + args.new_tokens
    print(f"model       {args.model} ({model_type}, {family}, {cfg.num_hidden_layers} layers, "
          f"k={k} ({runtime.selection_name}), vocab {cfg.vocab_size})")
    kv_rows = f", KV rows {args.kv_dtype} ({runtime.row_bytes} B), indexer keys {args.index_dtype} " \
              f"({runtime.index_row_bytes} B)" if family == "DSA" else ""
    print(f"device      {device}{interp}, {str(dtype).removeprefix('torch.')}{kv_rows}")
    slots = (f", cache slots B={args.cache_slots} ({args.cache_slots / k:g}k)" if args.mode != "resident" else "")
    print(f"mode        {args.mode}{slots}{', prefetch' if args.prefetch else ''}, "
          f"{'CUDA graph' if args.graph else 'eager'}")
    print(f"requests    {len(prompts)}, prompt lengths {[len(p) for p in prompts]}, {args.new_tokens} new tokens, "
          f"capacity {capacity} tokens{f', prefill chunks of {args.chunk_size}' if args.chunk_size else ''}, "
          f"seed {args.seed}")

    try:
        sampling = [SamplingParams(args.temperature, args.top_p, args.top_k, args.min_p, (args.seed + b) % 2**63,
                                   args.presence_penalty, args.frequency_penalty, {}, args.logprobs,
                                   args.stop_token_ids, args.ignore_eos, args.min_tokens).check(cfg.vocab_size)
                    for b in range(len(prompts))]
    except ValueError as e:
        ap.error(f"argument --{str(e).split('=', 1)[0].replace('_', '-')}: {e}")
    if not sampling[0].greedy:
        print(f"sampling    {sampling[0]}")
    start = time.perf_counter()
    out = engine.generate(prompts, args.new_tokens, graph=args.graph, keep_logits=False, progress=progress,
                          sampling=sampling)
    wall = time.perf_counter() - start
    progress("done")

    for b, (prompt, row) in enumerate(zip(prompts, out.tokens.tolist())):
        row = [t for t in row if t >= 0]          # -1 after a stop
        reason = out.finish_reasons[b]
        if tokenizer is not None:                  # the text, cut where a stop string begins
            stream = TextStream(tokenizer, prompt.tolist(), tuple(args.stop), args.min_tokens)
            pieces = []
            for n, token in enumerate(row, 1):
                piece, stopped = stream.add(token, n)
                pieces.append(piece)
                if stopped:
                    row, reason = row[:n], "stop"
                    break
            else:
                piece, stopped = stream.finish(len(row))
                pieces.append(piece)
                reason = "stop" if stopped else reason
        print(f"request {b}: prompt [{_fmt_tokens(prompt.tolist(), args.show_tokens)}] -> "
              f"[{_fmt_tokens(row, args.show_tokens)}] ({reason})")
        if tokenizer is not None:
            print(f"  text: {tokenizer.decode(prompt.tolist())!r} -> {''.join(pieces)!r}")
        for n, (chosen, top) in enumerate(out.token_logprobs[b][:min(len(row), args.show_tokens)]):
            print(f"  token {n}: {row[n]} logprob {chosen:.4f}; top " + ", ".join(f"{i} {lp:.4f}" for i, lp in top))
    batch = len(prompts)
    if out.timed_steps > 0 and out.decode_s > 0:
        print(f"tokens/s    {batch * out.timed_steps / out.decode_s:.2f} "
              f"({batch} requests x {out.timed_steps} timed decode steps in {out.decode_s:.3f} s)")
        print(f"TPOT        {1000 * out.decode_s / out.timed_steps:.3f} ms per output token (per step)")
    else:
        need = 3          # the first decode step warms up (compiles; precedes a capture)
        print(f"tokens/s    n/a (no timed decode step: needs --new-tokens >= {need})")
        print("TPOT        n/a")
    if args.mode != "resident":
        print(f"miss rate   {out.miss_rate:.4f} ({out.misses} misses, {out.hits} hits over "
              f"{args.new_tokens - 1} decode steps)")
    print(f"KV on {'GPU' if device.type == 'cuda' else 'CPU'}   {_mib(out.kv_bytes_per_request)} per request")
    if device.type == "cuda":
        print(f"GPU memory  {_mib(torch.cuda.max_memory_allocated(device))} peak allocated (all, weights included)")
    print(f"wall time   {wall:.3f} s (prefill + decode)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        return run(ap, ap.parse_args(argv))
    except SystemExit as e:               # argparse errors (2) and --help (0) as a return code
        return e.code if isinstance(e.code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
