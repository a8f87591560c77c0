"""python -m hisparse.serve: an OpenAI-compatible HTTP server over the serving engine.

    python -m hisparse.make_tiny --family deepseek_v32 --out /tmp/tiny
    python -m hisparse.serve --model /tmp/tiny --mode hisparse --cache-slots 16 --port 8000
    curl -s localhost:8000/v1/completions -d '{"prompt": "The cache", "max_tokens": 4, "stop": ["."]}'
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}'
    python -m hisparse.serve.bench --url http://127.0.0.1:8000 --concurrency 2 --input-len 32 --output-len 8

Endpoints: POST /v1/completions (prompts as text or token ids; sampling settings, stop strings,
logprobs, echo; `stream` for server-sent events), POST /v1/chat/completions (the tokenizer's chat
template), GET /v1/models (the model and how it is served), GET /health, GET /metrics (prometheus_client's
text: request and token counters, sizes, TTFT/TPOT/ITL histograms in seconds; `metrics.py`).
The checkpoint's tokenizer (tokenizer.json / tokenizer_config.json in its folder, or --tokenizer DIR)
reads text prompts and writes the answers' text; without one, prompts are token ids and a text
prompt or a chat request is refused, saying so.
Refusals are OpenAI's JSON errors (a 4xx naming the field); each request gets an access-log line on
stderr. Sizes the machine cannot hold (--max-context, --kv-budget-gib, --host-budget-gib) are
refused at start-up, before anything large is allocated. SIGINT or SIGTERM: new requests get 503,
those in flight finish (for up to --shutdown-timeout s, then they are cancelled), the server closes
with every stream and host row freed, exit 0.
With --disaggregated each prompt is prefilled by a worker process (one per --prefill-devices device,
e.g. cuda:1,cuda:2) and decoded here from its handoff; the endpoint answers as co-located.
Without a GPU the kernels run in Triton's interpreter (slow: tiny checkpoints, short prompts).
With --workload (DSA), each request replays its own draw of a synthetic preset's selections, as the
sweep's serving studies do, so a load over HTTP sits beside the in-process study's point:
    python -m hisparse.serve --model DIR --mode hisparse --cache-slots 4096 --graph --workload dsa_100k \
        --workload-input-len 16384 --workload-output-len 1024 --draw-cache /tmp/draws ...
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from functools import partial
from pathlib import Path

import torch

from hisparse.dsa.fp8 import KV_DTYPES
from hisparse.dsa.fp8_index import INDEX_DTYPES
from hisparse.engine import family_runtime
from hisparse.models.loading import load_model
from hisparse.generate import DTYPES, checkpoint_error, load_checkpoint, parse_device, positive_int
from hisparse.serve.app import ACCESS_LOG, Service, closing_line, describe, log, serve
from hisparse.serve.prefill import PrefillPool
from hisparse.serve.sizes import refusal
from hisparse.serve.worker import ReplayWorkload, ServerThread
from hisparse.serving import PREFILL_LAYERS, SERVING_MODES, Server
from hisparse.synthetic import PRESETS, request_draws
from hisparse.text import Tokenizer, load_tokenizer


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 0 to 65535 (0: any free port), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hisparse.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", metavar="DIR",
                    help="(required) checkpoint directory: config.json plus *.safetensors (Hugging Face layout), e.g. one "
                         "written by `python -m hisparse.make_tiny`")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json with its chat "
                         "template) to read text prompts and write text with (default: the --model folder's, if it "
                         "has one; else prompts are token ids)")
    ap.add_argument("--mode", choices=SERVING_MODES, default="resident",
                    help="resident (all KV on the GPU, the baseline), hisparse (host pool + --cache-slots GPU slots "
                         "per stream, exact), noio (hisparse without the copies: wrong tokens, the time's upper "
                         "bound) or hybrid (sized as hisparse; a request is resident in the GPU memory its "
                         "lanes leave while it fits, hierarchical otherwise, exact) (default resident)")
    ap.add_argument("--cache-slots", type=positive_int, default=None, metavar="B",
                    help="GPU slots per stream, at least the model's selection size k; required for hisparse, hybrid and "
                         "noio, ignored in resident mode")
    ap.add_argument("--token-budget", type=positive_int, default=None, metavar="T",
                    help="Quest checkpoints (llama, qwen3) only: tokens each KV head reads per step (default the "
                         "model's)")
    ap.add_argument("--kv-budget-gib", type=_positive_float, default=1.0, metavar="X",
                    help="GPU memory for KV in GiB: lanes, the cache and the prefill workspace; sets how many "
                         "requests decode at once (default 1)")
    ap.add_argument("--host-budget-gib", type=_positive_float, default=None, metavar="Y",
                    help="the host pool in GiB (hierarchical modes; default: every lane at --max-context); with "
                         "--prefix-cache also the most its host copies take (every mode)")
    ap.add_argument("--max-context", type=positive_int, default=4096, metavar="N",
                    help="the most tokens a request may hold, prompt plus max_tokens (default 4096)")
    ap.add_argument("--max-batch", type=positive_int, default=16, metavar="N",
                    help="the most lanes (requests decoding at once), whatever the budget fits (default 16)")
    ap.add_argument("--prefill-chunk", type=positive_int, default=8192, metavar="N",
                    help="prompt tokens prefilled per iteration, between two decode steps: larger cuts TTFT a little, "
                         "smaller makes each stall of the running requests shorter (their mean TPOT stays) "
                         "(default 8192)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="keep prompts' whole pages (--mode hisparse: shared host pages; else host copies within "
                         "--host-budget-gib); a prompt that extends a cached one is prefilled from where the cache "
                         "ends (counts on /metrics; not with --disaggregated)")
    ap.add_argument("--prefill-overlap", action="store_true",
                    help="DSA checkpoints: run each prefill chunk in pieces of --prefill-layers layers on a side CUDA "
                         "stream beside the decode steps, instead of alone between them (one piece in flight)")
    ap.add_argument("--prefill-layers", type=positive_int, default=None, metavar="N",
                    help=f"with --prefill-overlap: layers of a prefill piece (default {PREFILL_LAYERS})")
    ap.add_argument("--prefill-sms", type=positive_int, default=None, metavar="N",
                    help="with --prefill-overlap, on a GPU: run the pieces in a CUDA green context of N SMs, the "
                         "decode steps keeping the rest (default: every SM shared)")
    ap.add_argument("--prefill", choices=("model", "reference"), default="model",
                    help="model: the family's prefill kernels (default); reference: the eager torch prefill")
    ap.add_argument("--graph", action="store_true",
                    help="decode steps in one captured CUDA graph (needs a CUDA GPU)")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                    help="DSA checkpoints: how each MLA latent row is stored: bf16 (its 576 values in --dtype) or fp8 "
                         "(DeepSeek-V3.2's 656-byte rows; needs 512 + 64 latents; an FP8 kernel decodes "
                         "them) (default bf16)")
    ap.add_argument("--index-dtype", choices=INDEX_DTYPES, default="bf16",
                    help="DSA checkpoints: how each indexer key is stored: bf16 (in --dtype) or fp8 (DeepSeek-V3.2's "
                         "e4m3 key and float32 scale a token, 132 bytes at head dim 128) (default bf16)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="weight and KV dtype (default bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--device", default=None,
                    help="torch device (default cuda when a GPU is present, else cpu through Triton's interpreter)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the "
                         "network, with no authentication)")
    ap.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0: any free port)")
    ap.add_argument("--workload", default=None, metavar="PRESET",
                    help="DSA checkpoints: every request replays its own draw of this synthetic preset's selections "
                         "(e.g. dsa_100k, the calibrated locality) instead of the model's indexer, as the sweep's "
                         "serving studies do; requests must then have --workload-input-len prompt tokens and at "
                         "most --workload-output-len max_tokens (default: the model's own selections)")
    ap.add_argument("--workload-input-len", type=positive_int, default=None, metavar="N",
                    help="with --workload: the prompt length the draws are made for (required)")
    ap.add_argument("--workload-output-len", type=positive_int, default=None, metavar="N",
                    help="with --workload: the most tokens out a draw covers (required)")
    ap.add_argument("--workload-draws", type=positive_int, default=16, metavar="N",
                    help="with --workload: draws made at start-up, request n replaying draw n mod N (the sweep's "
                         "request n gets the same one); tens of seconds each at 61 layers (default 16)")
    ap.add_argument("--draw-cache", default=None, metavar="DIR",
                    help="with --workload: read the draws from (and write new ones to) this folder, shared with "
                         "`python -m experiments.sweep --draw-cache`")
    ap.add_argument("--disaggregated", action="store_true",
                    help="prefill every prompt in a worker process of its own (one per --prefill-devices device) and "
                         "decode it here from its handoff, as a prefill/decode-disaggregated deployment does; a "
                         "worker that dies fails the prompts it held (a 503 naming it) and is started again")
    ap.add_argument("--prefill-devices", default=None, metavar="LIST",
                    help="with --disaggregated: the prefill workers' devices, one worker each, e.g. cuda:1,cuda:2 or "
                         "cpu,cpu (default: one worker on --device)")
    ap.add_argument("--shutdown-timeout", type=_positive_float, default=30.0, metavar="S",
                    help="on SIGINT / SIGTERM, seconds the requests in flight get to finish before they are "
                         "cancelled (default 30)")
    return ap


def build_server(ap: argparse.ArgumentParser, args: argparse.Namespace, model=None, name: str | None = None):
    """(Server, model name, ReplayWorkload or None): the checkpoint's model (or `model`, already on
    its device, named `name`) in a Server sized by the options; an option that cannot work is ap.error."""
    if model is not None:
        return _server(ap, args, model, name or type(model).__name__)
    if args.model is None:
        ap.error("the following arguments are required: --model")
    device = parse_device(ap, args.device)
    if args.graph and device.type != "cuda":
        ap.error("argument --graph: CUDA graphs need a CUDA GPU and none is in use")
    if device.type == "cpu" and torch.cuda.is_available():
        ap.error("argument --device: cpu runs the kernels in Triton's interpreter, which a process that sees a GPU "
                 "does not use: run with CUDA_VISIBLE_DEVICES= instead")
    if not (Path(args.model) / "config.json").is_file():
        checkpoint_error(ap, f"argument --model: no config.json in checkpoint directory {args.model!r}")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    return _server(ap, args, load_checkpoint(ap, args.model, dtype, device), Path(args.model).resolve().name)


def _server(ap: argparse.ArgumentParser, args: argparse.Namespace, model, name: str):
    if args.kv_dtype != "bf16" and model.config.model_type not in ("deepseek_v32", "glm_moe_dsa"):
        ap.error(f"argument --kv-dtype: {args.kv_dtype} rows are DSA's (deepseek_v32, glm_moe_dsa); {name!r} is a "
                 f"{model.config.model_type} model")
    if args.index_dtype != "bf16" and model.config.model_type not in ("deepseek_v32", "glm_moe_dsa"):
        ap.error(f"argument --index-dtype: {args.index_dtype} keys are DSA's indexer's (deepseek_v32, glm_moe_dsa); "
                 f"{name!r} is a {model.config.model_type} model")
    try:
        runtime = family_runtime(model, args.token_budget, kv_dtype=args.kv_dtype, index_dtype=args.index_dtype)
    except ValueError as exc:
        option = "--kv-dtype" if args.kv_dtype != "bf16" and "kv_dtype" in str(exc) else "--model"
        ap.error(f"argument {option}: model {name!r} does not fit the kernels: {exc}")
    quest = {} if args.token_budget is None else {"token_budget": args.token_budget}
    if args.prefill_layers is not None and not args.prefill_overlap:
        ap.error("argument --prefill-layers: only with --prefill-overlap (the layers of a piece run beside a step)")
    if args.prefill_sms is not None and not args.prefill_overlap:
        ap.error("argument --prefill-sms: only with --prefill-overlap (it confines the pieces run beside a step)")
    check_sizes(ap, args, runtime, model.model.embed_tokens.weight.device)
    workload = replay_workload(ap, args, model.config, name)
    try:
        server = Server(model, args.mode, cache_slots=args.cache_slots if args.mode != "resident" else None,
                        max_context=args.max_context, kv_budget_gib=args.kv_budget_gib,
                        host_budget_gib=args.host_budget_gib, max_batch=args.max_batch,
                        prefill_chunk=args.prefill_chunk, graph=args.graph, prefill=args.prefill, kv_dtype=args.kv_dtype,
                        prefill_overlap=args.prefill_overlap, prefill_layers=args.prefill_layers or PREFILL_LAYERS,
                        prefill_sms=args.prefill_sms, index_dtype=args.index_dtype, prefix_cache=args.prefix_cache,
                        selections=None if workload is None else workload.draws[0], **quest)
    except ValueError as exc:
        ap.error(f"{_option(str(exc))}cannot build the server: {exc}")
    return server, name, workload


# the Server's keywords its ValueErrors name, and the options that set them
OPTIONS = ("kv_budget_gib", "host_budget_gib", "max_context", "cache_slots", "max_batch", "prefill_chunk",
           "token_budget", "prefill_layers", "prefill_sms", "prefill_overlap", "prefix_cache")


def _option(message: str) -> str:
    """"argument --option: " for the first Server keyword a message names, else ""."""
    named = [(message.find(key), key) for key in OPTIONS if key in message]
    return f"argument --{min(named)[1].replace('_', '-')}: " if named else ""


def check_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace, runtime, device) -> None:
    """Sizes the machine cannot hold are refused now, naming the option (`sizes.refusal`)."""
    try:
        refused = refusal(runtime, device, args.mode, args.cache_slots, args.max_context, args.kv_budget_gib,
                          args.host_budget_gib, args.max_batch)
    except ValueError:
        return                                   # the Server's own checks say what is wrong
    if refused is not None:
        ap.error(f"argument {refused[0]}: {refused[1]}")


def check_workload_options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The --workload options agree with each other (before the checkpoint is read)."""
    lengths = (args.workload_input_len, args.workload_output_len)
    if args.workload is None:
        given = [name for name, value in (("--workload-input-len", lengths[0]), ("--workload-output-len", lengths[1]),
                                          ("--draw-cache", args.draw_cache)) if value is not None]
        if given:
            ap.error(f"argument {given[0]}: only with --workload")
        return
    if args.workload not in PRESETS:
        ap.error(f"argument --workload: unknown preset {args.workload!r}; expected one of {sorted(PRESETS)}")
    if None in lengths:
        ap.error("argument --workload: needs --workload-input-len and --workload-output-len (the request shape the "
                 "draws are made for)")
    if sum(lengths) > args.max_context:
        ap.error(f"argument --workload-output-len: {lengths[0]} prompt tokens plus {lengths[1]} out exceed "
                 f"--max-context {args.max_context}")


def replay_workload(ap: argparse.ArgumentParser, args: argparse.Namespace, config, name: str) -> ReplayWorkload | None:
    """The draws every request replays (--workload), made (or read from --draw-cache) now."""
    if args.workload is None:
        return None
    if config.model_type not in ("deepseek_v32", "glm_moe_dsa"):
        ap.error(f"argument --workload: replays DSA selections; {name!r} is a {config.model_type} model")
    log(f"hisparse.serve: drawing {args.workload_draws} requests' selections of {args.workload} "
        f"({args.workload_input_len} in, {args.workload_output_len} out) ...")
    try:
        draws = request_draws(args.workload, config, args.workload_input_len, args.workload_output_len,
                              args.workload_draws, cache=args.draw_cache)
    except ValueError as exc:               # e.g. prompts too short for k
        ap.error(f"argument --workload: {exc}")
    return ReplayWorkload(args.workload, args.workload_input_len, args.workload_output_len, draws)


def tokenizer_for(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Tokenizer | None:
    """The tokenizer of --tokenizer, else of the --model folder (None if it has none), read before
    the weights; refused if it cannot be read."""
    option, folder = ("--tokenizer", args.tokenizer) if args.tokenizer is not None else ("--model", args.model)
    if folder is None:
        return None
    try:
        tokenizer = load_tokenizer(folder)
    except ValueError as exc:
        ap.error(f"argument {option}: {exc}")
    if tokenizer is None and option == "--tokenizer":
        ap.error(f"argument --tokenizer: no tokenizer (tokenizer.json, tokenizer_config.json) in {folder!r}")
    return tokenizer


def check_vocabulary(ap: argparse.ArgumentParser, args: argparse.Namespace, tokenizer: Tokenizer | None,
                     vocab_size: int) -> None:
    """A tokenizer that can write ids outside the model's vocabulary is refused."""
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        ap.error(f"argument {'--tokenizer' if args.tokenizer else '--model'}: the tokenizer in {tokenizer.folder!r} "
                 f"has {tokenizer.vocab_size} ids, over the model's vocabulary of {vocab_size}")


async def _serve_until_signalled(service: Service, args: argparse.Namespace) -> dict:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def ready(port: int) -> None:
        log(f"hisparse.serve: {service.name} ({service.info['hisparse']['mode']}, "
            f"{service.info['hisparse']['lanes']} lanes) on http://{args.host}:{port}")
    return await serve(service, args.host, args.port, stop, args.shutdown_timeout, ready)


def main(argv: list[str] | None = None, model=None, name: str | None = None) -> int:
    """The command; `model` (already built and on its device, named `name`) is served instead of a
    --model checkpoint: e.g. the sweep's random study model, `experiments.sweep.build(study, device)`,
    as benchmarks/serving_http.sh does (its rows then name the in-process study's model)."""
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        check_workload_options(ap, args)
        tokenizer = tokenizer_for(ap, args)
        check_disaggregated_options(ap, args, model)
        server, name, workload = build_server(ap, args, model, name)
        check_vocabulary(ap, args, tokenizer, server.model.config.vocab_size)
        devices = prefill_devices(ap, args, server.device) if args.disaggregated else None
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    info = describe(server, name, args.kv_budget_gib, args.host_budget_gib,     # before its thread owns it
                    "model" if workload is None else workload.name, tokenizer)
    info["hisparse"]["prefill_devices"] = devices
    pool = None if devices is None else start_prefill_pool(args, server, devices)
    try:
        worker = ServerThread(server, workload, pool)
        _log_access()
        log(f"hisparse.serve: warming up on {server.device} ...")
        worker.start()
        if pool is not None:
            try:
                pool.wait_ready(WORKER_START_S)
            except RuntimeError as exc:              # a prefill worker that could not start
                log(f"hisparse.serve: {exc}")
                worker.stop()
                return 1
            log(f"hisparse.serve: prefill workers ready: " +
                ", ".join(pool.name(i) for i in range(len(pool.workers))))
        service = Service(worker, info, tokenizer)
        try:
            final = asyncio.run(_serve_until_signalled(service, args))
        except OSError as exc:                       # the port is taken, the address not ours
            log(f"hisparse.serve: cannot listen on {args.host}:{args.port}: {exc}")
            worker.stop()
            return 1
    finally:
        if pool is not None:
            pool.close()
            log(f"hisparse.serve: {len(pool.workers)} prefill workers closed ({pool.restarts} restarted)")
    log(closing_line(final))
    return 0


WORKER_START_S = 3600.0     # the longest a prefill worker may take to build its model (a large checkpoint)


def check_disaggregated_options(ap: argparse.ArgumentParser, args: argparse.Namespace, model) -> None:
    if not args.disaggregated:
        if args.prefill_devices is not None:
            ap.error("argument --prefill-devices: only with --disaggregated")
        return
    if model is not None:
        ap.error("argument --disaggregated: the prefill workers load --model's checkpoint; an in-process model "
                 "cannot be handed to them")
    if args.prefill_overlap:
        ap.error("argument --prefill-overlap: with --disaggregated the prompts are prefilled by the workers, not "
                 "beside the decode steps")
    if args.prefix_cache:
        ap.error("argument --prefix-cache: with --disaggregated every prompt comes prefilled by a worker, so a cached "
                 "prefix would never be used (the workers do not share prefixes yet)")


def prefill_devices(ap: argparse.ArgumentParser, args: argparse.Namespace, decode: torch.device) -> list[str]:
    """The --prefill-devices, each checked, of the decode device's kind (their rows must be alike)."""
    if args.prefill_devices is None:
        return [str(decode)]
    devices = []
    for text in args.prefill_devices.split(","):
        try:
            device = torch.device(text.strip())
        except (RuntimeError, ValueError):
            ap.error(f"argument --prefill-devices: unknown device {text!r}; expected e.g. cuda:1,cuda:2 or cpu")
        if device.type != decode.type:
            ap.error(f"argument --prefill-devices: {text!r} is not a {decode.type} device as the decode server's "
                     f"{decode} is (a worker's rows must be stored as the decode server's)")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            ap.error(f"argument --prefill-devices: {text!r} does not exist ({torch.cuda.device_count()} GPUs)")
        devices.append(str(device))
    return devices


def start_prefill_pool(args: argparse.Namespace, server, devices: list[str]) -> PrefillPool:
    """A worker per device, each loading the checkpoint there, with the decode server's prefill settings."""
    dtype = server.model.model.embed_tokens.weight.dtype
    builders = [(device, partial(load_model, args.model, dtype=dtype, device=device)) for device in devices]
    pool = PrefillPool(builders, prefill_chunk=args.prefill_chunk, prefill=args.prefill,
                       decode_backend=server.decode_backend, kv_dtype=args.kv_dtype, token_budget=args.token_budget,
                       index_dtype=args.index_dtype)
    for i in range(len(devices)):
        log(f"hisparse.serve: {pool.name(i)} loading {args.model} ...")
    return pool


def _log_access() -> None:
    """The access log (a line per request, `app.AccessLog`) on stderr."""
    if not ACCESS_LOG.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        ACCESS_LOG.addHandler(handler)
    ACCESS_LOG.setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
