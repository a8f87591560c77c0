"""Run every point of a sweep config and append long-format rows to out/ (DESIGN section 9).

    python -m experiments.sweep                                  # experiments/configs/default.toml -> out/
    python -m experiments.sweep --config experiments/configs/h200.toml --out results   # the committed rows
    python -m experiments.sweep --dry-run                        # list the points, run nothing

Rows go to --out, by default out/, which git ignores; `--out results` appends to the committed
results that the README cites, which take GPU rows only (a run without a GPU is refused there,
the policy study excepted: it runs on the host wherever).

A config is a list of `[[study]]` tables; each `kind` has its own keys (listed after the options,
and in the shipped configs). Every point is validated before anything runs; points whose rows are already in
the output (same parameters, same GPU) are skipped unless --force, so an interrupted sweep resumes;
a point stored from a run made another way (new_tokens, warmup_steps, graph, prefetch, decode_backend)
runs again, and the figures read its newest rows.

kinds:
- policies:   replacement policies on a synthetic workload preset  -> policies.csv
- decode:     the decode loop, per mode x cache slots x context x batch -> decode.csv
- throughput: per context, the largest batch whose KV fits a GPU (and host) memory budget, in each
              mode, and decode tokens/s at that batch (the paper's peak generation throughput; DSA's
              hybrid: `hybrid_batch`) -> throughput.csv
- serving:    requests joining and leaving one batch (hisparse.serving) under the GPU and host budgets,
              a closed loop of C clients per concurrency level (or Poisson arrivals per rate, or
              bench_serving's random dataset per request_rate), each mode: output tokens/s, TTFT,
              TPOT, running batch -> serving.csv

Models: "tiny:<family>" (a small random model of a hisparse.models.tiny family: deepseek_v32,
glm_moe_dsa, llama, qwen3), "dsa" (DSA's real KV geometry: 128 heads, 512 + 64 latents, k = 2048, a
64 x 128 indexer), "dsa_v32_ep8" (the same geometry at DeepSeek-V3.2's hidden size and vocabulary, with MoE
layers whose decode step reads the weight bytes one GPU of an 8-GPU expert-parallel DeepSeek-V3.2
reads, its GPU KV budget by default what an H200 has left beside them: experiments/study_model.py),
"quest" (Llama-3-8B's KV geometry under Quest: 32 query and 8 KV heads of 128, the
first 2 of 32 layers dense, k = token_budget // 16 pages; `token_budget`, default 2048), with
`layers` and `hidden` setting the rest, which is smaller than the real models (a tiny model takes
`layers` too; both are part of each point); or a DSA checkpoint directory (its tensors' names and shapes
checked against its config.json, from the file headers, before anything runs). Selections come from the
model (workload = "model") or replay a synthetic preset (`hisparse.synthetic.PRESETS`) with realistic
locality (Quest: per KV head, in pages, `per_kv_head_workload`); decode and throughput runs fill the
prompt's KV with random rows.
How a decode study runs, recorded beside each row: `graph` (CUDA graphs, on a GPU), `prefetch`
(layer-wise prefetch, for models whose layers share a selection), `decode_backend` (DSA: the sparse
MLA decode kernel asked for, auto, triton or gluon) and `attention_kernel` (the one that ran: for DSA
`gluon` on Hopper with Triton 3.6 under auto, else `triton`; `triton` for NSA and Quest).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import time
import tomllib
from pathlib import Path

import pandas as pd
import torch

from experiments.policies import study as policy_study
from experiments.study_model import KV_BUDGET_GIB, STUDY_MODEL, study_config
from hisparse.dsa.fp8 import (
    KV_DTYPES,
    ROW_BYTES,
    check_fp8_geometry,
    stored_decode_kernel,
)
from hisparse.dsa.fp8_index import INDEX_DTYPES, stored_index_bytes
from hisparse.dsa.ops import DECODE_BACKENDS
from hisparse.dsa.runtime import KV_MODES, DsaRuntime
from hisparse.engine import Engine
from hisparse.host_pool import release_cached_memory
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model, check_checkpoint, load_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_
from hisparse.resolve import MAX_SLOTS, CacheState
from hisparse.results import (
    DEFAULT_OUT,
    HOST_BENCHES,
    OUT_HELP,
    append_rows,
    cpu_rows_refused,
    environment,
    out_note,
    read_stored_rows,
)
from hisparse.runtime import nbytes
from hisparse.serving import GIB, PREFILL_LAYERS, Request, Server, benchmark_summary
from hisparse.serving.request import DIALECT_METRICS, percentile
from hisparse.serving.workload import (
    DATASETS,
    REQUESTS_PER_CLIENT,
    RandomWorkload,
    attach_selections,
    point_workload,
    serving_request_count,
    serving_requests,
)
from hisparse.synthetic import (
    PRESETS,
    batch_workload,
    fill_draw_cache,
    per_kv_head_config,
    per_kv_head_workload,
    preset,
    request_draws,
)
from hisparse.traces import with_anchors

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.toml"
KEYS = {
    "policies": {"kind", "workload"},
    "decode": {"kind", "model", "layers", "hidden", "modes", "cache_slots", "contexts", "batches", "new_tokens",
               "warmup_steps", "workload", "graph", "prefetch", "token_budget", "decode_backend", "kv_dtype",
               "index_dtype"},
    "throughput": {"kind", "model", "layers", "hidden", "modes", "cache_slots", "contexts", "kv_budget_gib",
                   "host_budget_gib", "max_batch", "new_tokens", "warmup_steps", "workload", "graph", "token_budget",
                   "kv_dtype", "index_dtype"},
    "serving": {"kind", "model", "layers", "hidden", "modes", "cache_slots", "input_len", "output_len", "concurrency",
                "rates", "requests_per_client", "requests", "kv_budget_gib", "host_budget_gib", "max_batch",
                "prefill_chunk", "prefill_overlap", "prefill_layers", "prefill_sms", "graph", "token_budget",
                "decode_backend", "workload", "kv_dtype", "index_dtype", "request_rate", "num_prompts", "range_ratio",
                "max_concurrency", "seed", "disaggregated", "prefix_cache", "dataset", "conversations", "turns", "first_len",
                "user_len", "document_len", "question_len"},
}
REQUIRED = {"policies": {"workload"}, "decode": {"model", "modes", "contexts", "batches"},
            "throughput": {"model", "modes", "contexts", "kv_budget_gib"},
            "serving": {"model", "modes", "output_len", "kv_budget_gib"}}     # input_len: dataset random
DEFAULTS = {"new_tokens": 8, "warmup_steps": 1, "max_batch": 256,     # optional keys validate fills in
            "requests_per_client": REQUESTS_PER_CLIENT, "requests": 8, "prefill_chunk": 8192,
            "num_prompts": 8, "range_ratio": 1.0, "seed": 0}
DIALECT_KEYS = ("num_prompts", "range_ratio", "max_concurrency", "seed")   # a request_rate study's own
DATASET_KEYS = {"multiturn": ("conversations", "turns", "first_len", "user_len"),    # a dataset's own keys
                "shared_document": ("document_len", "question_len")}
TOKEN_BUDGET = {"quest": 2048}            # Quest's tokens per KV head and step, where a study sets none
TINY_TOKEN_BUDGET = 48                    # the tiny Quest models: k = 3 pages
# what each key means and, for an optional one, its default (`--help` lists them per kind)
KEY_HELP = {
    "kind": "policies, decode, throughput or serving",
    "workload": "a synthetic preset, or (decode, throughput) 'model': the model's own selections, the default",
    "model": f"tiny:<family>, dsa, {STUDY_MODEL}, quest, or a DSA checkpoint directory",
    "layers": f"layers of the dsa and {STUDY_MODEL} (61) / quest (32) / tiny model",
    "hidden": f"hidden size of the dsa / quest model (1024), of {STUDY_MODEL} (7168)",
    "modes": "list of resident, hisparse, noio (and hybrid: serving, every family; throughput, DSA)",
    "cache_slots": "B, one or a list (needed by hisparse, noio and hybrid)",
    "contexts": "prompt tokens, one or a list (decode, throughput)",
    "batches": "requests, one or a list",
    "new_tokens": f"timed decode steps ({DEFAULTS['new_tokens']})",
    "warmup_steps": f"untimed steps first ({DEFAULTS['warmup_steps']})",
    "graph": "CUDA graphs, on a GPU (false)",
    "prefetch": "layer-wise prefetch, for models whose layers share a selection (false)",
    "token_budget": f"Quest: tokens per KV head and step ({TOKEN_BUDGET['quest']}; tiny models {TINY_TOKEN_BUDGET})",
    "decode_backend": "DSA: the sparse MLA decode kernel, auto, triton or gluon (auto)",
    "kv_dtype": "DSA: a latent row as stored, bf16 (the model's dtype: 1152 bytes in bf16) or fp8 (656: FlashMLA's "
                "FP8 rows); rows of fp8 points say so, bf16 ones leave the column empty (bf16)",
    "index_dtype": "DSA: an indexer key as stored, bf16 (the model's dtype: 256 bytes at head dim 128 in bf16) or "
                   "fp8 (132: DeepSeek-V3.2's e4m3 key and float32 scale); as kv_dtype, bf16 rows leave it empty (bf16)",
    "kv_budget_gib": f"GPU memory for KV per point (GiB; {STUDY_MODEL}: {KV_BUDGET_GIB}, what an H200 has left beside "
                     f"its weights, results/notes/study_model.md)",
    "host_budget_gib": "pinned host memory for the host pool (GiB; no limit)",
    "max_batch": f"largest batch tried; serving: the most lanes ({DEFAULTS['max_batch']})",
    "input_len": "serving, dataset random: prompt tokens of every request (required there; the other datasets "
                 "derive it: their longest prompt)",
    "dataset": "serving: random (the default: input_len prompts), multiturn (conversations of turns, each prompt "
               "extending the last) or shared_document (one document, num_prompts questions at request_rate)",
    "conversations": "serving, multiturn: conversations at once, one or a list (the load: a closed loop of one "
                     "client per conversation, its turns in order)",
    "turns": "serving, multiturn: turns per conversation",
    "first_len": "serving, multiturn: the first turn's prompt tokens (a system prompt and the first message)",
    "user_len": "serving, multiturn: tokens of each later user message (a turn's prompt: the previous prompt, its "
                "answer of output_len random tokens fixed in advance, the message)",
    "document_len": "serving, shared_document: the document's tokens, the start of every prompt",
    "question_len": "serving, shared_document: each question's tokens, after the document",
    "output_len": "serving: tokens each request generates (its first from the prefill)",
    "concurrency": "serving: closed-loop client counts, one or a list (or rates, or request_rate)",
    "rates": "serving: open-loop Poisson arrival rates, requests/s, one or a list (or concurrency, or request_rate)",
    "request_rate": "serving: bench_serving's random dataset at these Poisson rates, requests/s (inf: every "
                    "request at once), one or a list (or concurrency, or rates); its points carry request_rate, "
                    "num_prompts, range_ratio, max_concurrency and seed",
    "num_prompts": f"serving, with request_rate: requests per rate ({DEFAULTS['num_prompts']})",
    "range_ratio": f"serving, with request_rate: prompt and output lengths uniform over [len * range_ratio, len], "
                   f"in (0, 1] ({DEFAULTS['range_ratio']}: input_len in, output_len out; a preset workload takes 1)",
    "max_concurrency": "serving, with request_rate: at most this many requests out at once, a request due while "
                       "they are waits for one to end (no cap)",
    "seed": f"serving, with request_rate: the seed of lengths, prompts and arrivals ({DEFAULTS['seed']})",
    "requests_per_client": f"serving, closed loop: requests each client sends ({DEFAULTS['requests_per_client']}; "
                           "another value is carried in the rows' requests_per_client column, the default's "
                           "leave it empty)",
    "requests": f"serving, open loop: requests per rate ({DEFAULTS['requests']})",
    "prefill_chunk": f"serving: prompt tokens prefilled per iteration, between decode steps, one or a list "
                     f"({DEFAULTS['prefill_chunk']})",
    "prefill_overlap": "serving, DSA: prefill chunks in pieces of prefill_layers layers beside the decode steps (Server's "
                       "prefill_overlap) instead of alone between them; true, false or [false, true] (false); "
                       "rows of true points say so, false ones leave the column empty",
    "prefix_cache": "serving, every family and mode: prompts' whole pages kept (hisparse: shared host pages; "
                    "else host copies in the host budget), a cached prefix not prefilled again (Server's "
                    "prefix_cache; not with disaggregated); true, false or [false, true] (false)",
    "disaggregated": "serving: the decode instance of a prefill/decode-disaggregated deployment, emulated on one "
                     "GPU (Server's disaggregated: each prompt prefilled at admission with the clock stopped, "
                     "its time the prefill_elsewhere metric); true, false or [false, true] (false)",
    "prefill_layers": "serving, with prefill_overlap = true: layers of a prefill piece (4); rows of the overlapped "
                      "points say it where it is not 4",
    "prefill_sms": "serving, with prefill_overlap = true, on a GPU: the pieces run in a CUDA green context of this "
                   "many SMs, the decode steps keep the rest (unset: every SM shared); rows of the overlapped points "
                   "say it",
}


def keys_help() -> str:
    """The keys of each kind, required ones first, for `--help`."""
    out = ["keys of a [[study]] (* required; defaults in brackets):"]
    for kind, keys in KEYS.items():
        out.append(f"  {kind}:")
        for key in sorted(keys - {"kind"}, key=lambda k: (k not in REQUIRED[kind], k)):
            out.append(f"    {key + ('*' if key in REQUIRED[kind] else ''):15} {KEY_HELP[key]}")
    return "\n".join(out)


DSA_GEOMETRY = dict(model_type="deepseek_v32", vocab_size=1024, num_attention_heads=128, kv_lora_rank=512,
                    q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_topk=2048,
                    index_head_dim=128, index_n_heads=64, moe_intermediate_size=256, n_routed_experts=8,
                    n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1)
QUEST_GEOMETRY = dict(model_type="llama", vocab_size=1024, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128)                # quest_dense_layers: the default, min(2, layers)
DSA_TYPES, QUEST_TYPES = ("deepseek_v32", "glm_moe_dsa"), ("llama", "qwen3")


def family(config) -> str:
    """"dsa" or "quest": how a model of this config (a dict, or a model's config) selects."""
    model_type = config["model_type"] if isinstance(config, dict) else config.model_type
    return "dsa" if model_type in DSA_TYPES else "quest"


def token_budget(study: dict) -> int | None:
    """A Quest study's token budget (None for DSA)."""
    if family(model_config(study)) != "quest":
        return None
    return study.get("token_budget", TOKEN_BUDGET.get(study["model"], TINY_TOKEN_BUDGET))


def selection_size(study: dict, raw: dict) -> int:
    """k: tokens (DSA) or 16-token pages (Quest) each stream selects per step."""
    return raw["index_topk"] if family(raw) == "dsa" else token_budget(study) // 16


class ConfigError(ValueError):
    pass


SIZED_MODELS = {"dsa": (61, 1024), STUDY_MODEL: (61, 7168), "quest": (32, 1024)}   # default (layers, hidden)


def utf8_text(path: Path, what: str) -> str:
    """The text of `path`, which TOML and JSON files hold as UTF-8; ConfigError naming the first byte that
    is not (the caller names the file)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}): {what} is "
                          f"UTF-8") from None


# -- config ----------------------------------------------------------------------------------

def model_config(study: dict) -> dict:
    """The model's config dict (no weights): what validation needs to know k and the layer count."""
    spec, where = study["model"], f"study {study.get('_index', '')} ({study['kind']})"
    if spec.startswith("tiny:"):
        name = spec.split(":", 1)[1]
        if name not in DSA_TYPES + QUEST_TYPES:
            raise ConfigError(f"{where}: model {spec!r}: the sweep runs DSA and Quest families; expected "
                              f"tiny: and one of {list(DSA_TYPES + QUEST_TYPES)}")
        raw = dict(TINY_CONFIGS[name])
    elif spec == "dsa":
        layers, hidden = study.get("layers", 61), study.get("hidden", 1024)
        raw = dict(DSA_GEOMETRY, num_hidden_layers=layers, first_k_dense_replace=layers, hidden_size=hidden,
                   intermediate_size=2 * hidden)
    elif spec == STUDY_MODEL:
        try:
            raw = study_config(study.get("layers", 61), study.get("hidden", 7168))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    elif spec == "quest":
        layers, hidden = study.get("layers", 32), study.get("hidden", 1024)
        raw = dict(QUEST_GEOMETRY, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden)
    elif (Path(spec) / "config.json").exists():
        try:
            raw = json.loads(utf8_text(Path(spec) / "config.json", "a JSON file"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: model {spec!r}: config.json is not valid JSON ({exc})") from None
        except ConfigError as exc:
            raise ConfigError(f"{where}: model {spec!r}: config.json: {exc}") from None
        if raw.get("model_type") not in ("deepseek_v32", "glm_moe_dsa"):
            raise ConfigError(f"{where}: model {spec!r} has model_type {raw.get('model_type')!r}: the sweep runs "
                              f"DSA models (deepseek_v32, glm_moe_dsa); other families run through "
                              f"python -m hisparse.generate and the benchmarks")
        if not any(Path(spec).glob("*.safetensors")):
            raise ConfigError(f"{where}: model {spec!r} has a config.json but no *.safetensors weights")
    else:
        raise ConfigError(f"{where}: model {spec!r} is neither tiny:<family>, dsa, {STUDY_MODEL}, quest, nor a "
                          f"checkpoint directory")
    if "layers" in study and spec.startswith("tiny:"):
        raw["num_hidden_layers"] = study["layers"]
    return raw


def is_checkpoint(spec: str) -> bool:
    """Whether a study's model is a checkpoint directory (not tiny:<family>, dsa, dsa_v32_ep8 or quest)."""
    return not spec.startswith("tiny:") and spec not in SIZED_MODELS


def check_study_checkpoint(spec: str, where: str) -> None:
    """A checkpoint directory's tensors against its config.json, as `load_model` checks them, from the
    safetensors headers alone (names, shapes and dtypes; no weight is read): a missing, misshapen or
    unexpected tensor is refused before any study runs, not when its point is reached."""
    try:
        check_checkpoint(spec)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{where}: checkpoint {spec!r}: {exc}") from None


def _positive_ints(study: dict, key: str, where: str) -> list[int]:
    value = study.get(key)
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ConfigError(f"{where}: {key} = {value!r}: expected a positive integer or a list of them")
    _listed_once(values, key, where)
    return values


def _switches(study: dict, key: str, where: str) -> list[bool]:
    """A serving switch (prefill_overlap, disaggregated, prefix_cache): true, false or a list of them
    (each once), as a list; absent is [false]."""
    values = study.get(key, False)
    values = values if isinstance(values, list) else [values]
    if not values or not all(isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}: {key} = {study[key]!r}: expected true, false or a list of them")
    _listed_once(values, key, where)
    return values


def _listed_once(values: list, key: str, where: str) -> None:
    """A list key (modes, contexts, batches, cache_slots) names each value once: a second one would run
    the same points again and append their rows twice."""
    seen = set()
    for v in values:
        if v in seen:
            raise ConfigError(f"{where}: {key} = {values!r} lists {v!r} twice: its points would run twice and "
                              f"write duplicate rows")
        seen.add(v)


def _positive_int(study: dict, key: str, where: str) -> int:
    value = study.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: {key} = {value!r}: expected one positive integer")
    return value


def validate(studies: list[dict]) -> None:
    """Every key and value of every study, before anything runs; errors name the study and key."""
    if not isinstance(studies, list) or not all(isinstance(s, dict) for s in studies):
        raise ConfigError("study must be an array of tables: write [[study]], not [study]")
    if not studies:
        raise ConfigError("the config has no [[study]] tables")
    for i, study in enumerate(studies):
        study["_index"] = i
        kind = study.get("kind")
        where = f"study {i} ({kind})"
        if not isinstance(kind, str) or kind not in KEYS:
            raise ConfigError(f"study {i}: kind = {kind!r}: expected one of {sorted(KEYS)}")
        unknown = set(study) - KEYS[kind] - {"_index"}
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; allowed: {sorted(KEYS[kind])}")
        if study.get("model") == STUDY_MODEL and kind in ("throughput", "serving"):
            study.setdefault("kv_budget_gib", KV_BUDGET_GIB)      # what an H200 has left beside the weights
        if kind == "serving":
            expand_dataset(study, where)
        missing = REQUIRED[kind] - set(study)
        if missing:
            raise ConfigError(f"{where}: missing key {sorted(missing)[0]!r}")
        workload = study.get("workload", "model")
        model_selects = kind != "policies" and workload == "model"
        if not isinstance(workload, str) or (workload not in PRESETS and not model_selects):
            raise ConfigError(f"{where}: workload = {workload!r}: expected 'model' or a preset of "
                              f"{sorted(PRESETS)}")
        if kind == "policies":
            continue
        modes = study["modes"]
        allowed = (*KV_MODES, "hybrid") if kind in ("throughput", "serving") else KV_MODES
        if not isinstance(modes, list) or not modes or any(m not in allowed for m in modes):
            raise ConfigError(f"{where}: modes = {modes!r}: expected a list of {allowed}"
                              + (" (hybrid: throughput and serving studies only)"
                                 if isinstance(modes, list) and "hybrid" in modes else ""))
        _listed_once(modes, "modes", where)
        if not isinstance(study["model"], str):
            raise ConfigError(f"{where}: model = {study['model']!r}: expected a string (tiny:<family>, dsa, quest or "
                              f"a checkpoint directory)")
        for key in ("graph", "prefetch"):
            if key in study and not isinstance(study[key], bool):
                raise ConfigError(f"{where}: {key} = {study[key]!r}: expected true or false")
        sizes = {"layers": f"the 'dsa', '{STUDY_MODEL}', 'quest' and tiny: models",
                 "hidden": f"the 'dsa', '{STUDY_MODEL}' and 'quest' models"}
        for key, models in sizes.items():
            sized = study["model"] in SIZED_MODELS or (key == "layers" and study["model"].startswith("tiny:"))
            if key in study and not sized:
                raise ConfigError(f"{where}: {key} = {study[key]!r} sizes {models}; model {study['model']!r} has "
                                  f"its own: drop {key}")
            if key in study:
                _positive_int(study, key, where)
        raw = model_config(study)
        if "hybrid" in modes and kind == "throughput" and family(raw) != "dsa":
            raise ConfigError(f"{where}: mode hybrid in a throughput study (the fixed-batch Engine) is built for "
                              f"DSA models so far; model {study['model']!r} is {family(raw)} (serving studies take "
                              f"hybrid in every family)")
        if "token_budget" in study:
            budget = study["token_budget"]
            if family(raw) != "quest":
                raise ConfigError(f"{where}: token_budget applies to Quest models; model {study['model']!r} "
                                  f"selects index_topk tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 16:
                raise ConfigError(f"{where}: token_budget = {budget!r}: expected an integer of at least one "
                                  f"16-token page")
        try:                  # the model's whole config, as the run will build it (defaults and older keys expanded)
            built = config_from_dict(dict(raw))
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{where}: model {study['model']!r}: {exc}") from None
        if is_checkpoint(study["model"]):     # what load_model would refuse once the studies before had run
            check_study_checkpoint(study["model"], where)
        shares = any(built.selection_anchor(i) != i for i in range(built.num_hidden_layers)) \
            if hasattr(built, "selection_anchor") else "shared" in getattr(built, "indexer_types", [])
        if "decode_backend" in study:
            backend = study["decode_backend"]
            if family(raw) != "dsa":
                raise ConfigError(f"{where}: decode_backend applies to DSA models (the sparse MLA decode kernel); "
                                  f"model {study['model']!r} is {family(raw)}")
            if backend not in DECODE_BACKENDS:
                raise ConfigError(f"{where}: decode_backend = {backend!r}: expected one of {DECODE_BACKENDS}")
        if "kv_dtype" in study:
            kv = study["kv_dtype"]
            if family(raw) != "dsa":
                raise ConfigError(f"{where}: kv_dtype applies to DSA models (how a latent row is stored); model "
                                  f"{study['model']!r} is {family(raw)}")
            if kv not in KV_DTYPES:
                raise ConfigError(f"{where}: kv_dtype = {kv!r}: expected one of {KV_DTYPES}")
            if kv == "fp8":
                try:
                    check_fp8_geometry(built)
                except ValueError as exc:
                    raise ConfigError(f"{where}: kv_dtype = \"fp8\": {exc}") from None
        if "index_dtype" in study:
            if family(raw) != "dsa":
                raise ConfigError(f"{where}: index_dtype applies to DSA models (how an indexer key is stored); "
                                  f"model {study['model']!r} is {family(raw)}")
            if study["index_dtype"] not in INDEX_DTYPES:
                raise ConfigError(f"{where}: index_dtype = {study['index_dtype']!r}: expected one of {INDEX_DTYPES}")
        if study.get("prefetch") and not shares:
            raise ConfigError(f"{where}: prefetch = true needs layers that share a selection (a glm_moe_dsa model "
                              f"with 'shared' indexer_types); model {study['model']!r} has none")
        if kind == "serving":
            validate_serving(study, where)
        else:
            study["contexts"] = _positive_ints(study, "contexts", where)       # one value or a list: a list
            study.setdefault("new_tokens", DEFAULTS["new_tokens"])
            _positive_int(study, "new_tokens", where)
            study.setdefault("warmup_steps", DEFAULTS["warmup_steps"])
            _positive_int(study, "warmup_steps", where)
        if kind == "decode":
            study["batches"] = _positive_ints(study, "batches", where)
        if workload != "model" and kind == "serving" and family(raw) != "dsa":
            raise ConfigError(f"{where}: workload = {workload!r}: a serving study replays a preset on DSA models; "
                              f"a Quest model's selections come from the model (workload = 'model')")
        if workload != "model":         # the synthetic selections need room for k units at every context
            for context in study.get("contexts", [study.get("first_len", study.get("input_len"))]):
                try:
                    if family(raw) == "quest":
                        per_kv_head_config(workload, 16, context, 1, selection_size(study, raw),
                                           raw["num_hidden_layers"], raw["num_key_value_heads"])
                    else:
                        preset(workload, context=context, k=raw["index_topk"], layers=raw["num_hidden_layers"],
                               **({"sinks": 1, "window": 2} if workload == "tiny" else {}))
                except ValueError as exc:
                    raise ConfigError(f"{where}: contexts = {study['contexts']!r}: workload {workload!r}: {exc}")
        if any(m != "resident" for m in study["modes"]):
            slots = _positive_ints(study, "cache_slots", where)
            k = selection_size(study, raw)
            if min(slots) < k:
                raise ConfigError(f"{where}: cache_slots {min(slots)} is smaller than the model's k = {k}")
            if max(slots) > MAX_SLOTS:
                raise ConfigError(f"{where}: cache_slots {max(slots)} exceeds the supported {MAX_SLOTS}")
        if kind in ("throughput", "serving"):
            for key in ("kv_budget_gib", "host_budget_gib"):
                value = study.get(key)
                if key in study and (isinstance(value, bool) or not isinstance(value, (int, float))
                                     or not (math.isfinite(value) and value > 0)):
                    raise ConfigError(f"{where}: {key} = {study[key]!r}: expected a positive, finite number (GiB)")
            study.setdefault("max_batch", DEFAULTS["max_batch"])
            _positive_int(study, "max_batch", where)


# -- points ----------------------------------------------------------------------------------

def points(study: dict) -> list[dict]:
    """The points of one study: parameter dicts (their keys become result columns)."""
    kind = study["kind"]
    if kind == "policies":
        return [{"bench": "policies", "workload": study["workload"]}]
    raw, budget = model_config(study), token_budget(study)
    base = {"family": family(raw), "workload": study.get("workload", "model"), "model": study["model"]}
    if study["model"] in SIZED_MODELS:      # its size is part of the point: two sizes' rows are not one point
        layers, hidden = SIZED_MODELS[study["model"]]
        base.update(layers=study.get("layers", layers), hidden=study.get("hidden", hidden))
    elif "layers" in study:                    # a tiny model of other than its own layer count
        base.update(layers=study["layers"])
    if budget is not None:
        base.update(token_budget=budget)
    if study.get("kv_dtype", "bf16") != "bf16":   # a bf16 point's rows leave kv_dtype empty, as before it existed
        base.update(kv_dtype=study["kv_dtype"])
    if study.get("index_dtype", "bf16") != "bf16":
        base.update(index_dtype=study["index_dtype"])
    slots = study.get("cache_slots", [None])
    slots = slots if isinstance(slots, list) else [slots]
    out = []
    # the modes compared at one context (and batch) run back to back: the GPU's clocks and the host's
    # memory drift less between them than across a whole study (a 3% comparison needs that)
    if kind == "serving":
        return serving_points(study, base, slots)
    batches = study["batches"] if kind == "decode" else [None]
    for context, batch, mode in itertools.product(study["contexts"], batches, study["modes"]):
        for b in (slots if mode != "resident" else [None]):
            if kind == "decode":
                out.append(dict(base, bench="decode", mode=mode, context=context, batch=batch, cache_slots=b))
            else:
                out.append(dict(base, bench="throughput", mode=mode, context=context, cache_slots=b,
                                kv_budget_gib=study["kv_budget_gib"], host_budget_gib=study.get("host_budget_gib")))
    return out


def _natural(text: str) -> tuple:
    """Sort key of a listed value: numbers by value, before the rest."""
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)


def done_points(path: Path) -> pd.DataFrame | None:
    """The rows already in a results file (None if there is none), read to skip the points they hold."""
    if not path.exists():
        return None
    try:
        done = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not a results CSV ({type(exc).__name__}: {exc}); move it away or pass "
                          f"another --out") from None
    if "gpu" not in done:
        raise ConfigError(f"{path} has no 'gpu' column: not a results file of this project; move it away or pass "
                          f"another --out")
    try:                    # what append_rows would refuse after the first point ran (a row wider than the header)
        read_stored_rows(path)
    except ValueError as exc:
        raise ConfigError(f"{exc} (or pass another --out)") from None
    return done


# point keys a point carries only where they differ from their default (their rows leave the column
# empty otherwise, as rows from before the key existed do)
OPTIONAL_POINT_KEYS = {"kv_dtype", "index_dtype", "prefill_overlap", "disaggregated", "prefix_cache", "prefill_layers", "prefill_sms",
                       "requests_per_client",
                       "transport",   # transport: HTTP rows (hisparse.serve.bench)
                       "request_rate", "num_prompts", "range_ratio", "max_concurrency", "seed",   # request_rate points
                       *DATASET_KEYS["multiturn"], *DATASET_KEYS["shared_document"], "dataset"}


def already_done(done: pd.DataFrame | None, point: dict, gpu: str, settings: dict | None = None) -> bool:
    """Whether `done` holds rows of `point` from `gpu`, run as `settings` say (`run_settings`; a row
    from before a setting was recorded matches any value of it)."""
    if done is None or done.empty:
        return False
    mask = done.gpu == gpu
    for key, value in point.items():
        if key not in done:
            return False
        mask &= _matches(done[key], value)
    for key in OPTIONAL_POINT_KEYS - set(point):      # a bf16 point is not done by its fp8 twin's rows
        if key in done:
            mask &= done[key].isna()
    for key, value in (settings or {}).items():
        if key in done:
            mask &= done[key].isna() | _matches(done[key], value)
    return bool(mask.any())


def _matches(col: pd.Series, value) -> pd.Series:
    if value is None:
        return col.isna()
    if isinstance(value, bool):           # stored as True / False, or as text where the column has gaps
        return col.astype(str) == str(value)
    if isinstance(value, (int, float)):
        return pd.to_numeric(col, errors="coerce") == value
    return col.astype(str) == value


def run_settings(study: dict, point: dict, on_gpu: bool) -> dict:
    """How a point runs, recorded beside its rows but not part of it: a point run again another way
    adds rows that the figures read instead (the newest of a point's). Empty for policies."""
    if point["bench"] == "policies":
        return {}
    if point["bench"] == "serving":
        settings = dict(graph=study.get("graph", False) and on_gpu)
        if point["family"] == "dsa":
            settings["decode_backend"] = study.get("decode_backend", "auto")
        return settings
    settings = dict(new_tokens=study["new_tokens"], warmup_steps=study["warmup_steps"],
                    graph=study.get("graph", False) and on_gpu,
                    prefetch=study.get("prefetch", False) and point["mode"] == "hisparse")
    if point["family"] == "dsa":
        settings["decode_backend"] = study.get("decode_backend", "auto")
    return settings


# -- running ---------------------------------------------------------------------------------

@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build(study: dict, device: torch.device) -> torch.nn.Module:
    spec = study["model"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if is_checkpoint(spec):
        return load_model(spec, dtype=dtype, device=device)
    # made on the device in the run's dtype: at DeepSeek's hidden size the 61 layers hold 62 GB of
    # bf16 weights, which in float32 on the host would not fit the GPU machine's memory
    with torch.device(device), default_dtype(dtype):
        model = build_model(config_from_dict(model_config(study)))
    # drawn on the GPU: on the host, DeepSeek's hidden size took 200 s per process (timings do not
    # depend on the values, and a run compares its modes on the same weights)
    randomize_(model, seed=0, on_device=device.type == "cuda")
    return model.to(device=device, dtype=dtype)


# Decode runs so far in this process. On the H200 every run from a process's 4th on took about 11.5%
# longer per step than the first three, whatever its mode: once PyTorch has captured 4 CUDA graphs in a
# process, the graphs it captured replay slower (results/notes/graphs.md), and each graphed run captures
# one. So rows record it.
decode_runs = 0
def graphs_of(point: dict, graph: bool) -> int:
    """CUDA graphs a point's run captures in its process, at most: one a decode run, two a hybrid
    serving run with graph (its mixed step and its all-resident one), none a policy study. `graph`:
    whether the run captures graphs (`run_settings`; the point itself does not say)."""
    if point["bench"] == "policies":
        return 0
    return 2 if point["bench"] == "serving" and point["mode"] == "hybrid" and graph else 1


def over_limit(runs: int, study: dict, point: dict, on_gpu: bool, limit: int) -> bool:
    """Whether `point` of `study`, run next in a process that has made `runs` decode runs, would take
    it past `limit` graphs (--runs-per-process): then the sweep goes on in a fresh process."""
    return runs + graphs_of(point, run_settings(study, point, on_gpu).get("graph", False)) > limit


draw_cache: Path | None = None       # --draw-cache: where serving requests' draws are kept
serving_warmed: set = set()          # (input_len, prefill_chunk, mode, kv_dtype, index_dtype) prefilled here


def run_decode(model, point: dict, batch: int, new_tokens: int, graph: bool, prefetch: bool = False,
               warmup_steps: int = 1, decode_backend: str = "auto"):
    global decode_runs
    decode_runs += 1
    cfg = model.config
    context, workload, budget = point["context"], point["workload"], point.get("token_budget")
    replay = None
    steps = new_tokens + warmup_steps          # new_tokens timed decode steps, after the untimed warm-up steps
    if workload != "model" and budget is not None:      # Quest: per KV head, in pages; dense layers stand
        replay = per_kv_head_workload(cfg, 16, context, steps, budget // 16, batch, workload,   # for the
                                      random_layers=cfg.quest_dense_layers)            # near-random first ones
    elif workload != "model":
        over = dict(context=context, steps=steps, k=cfg.index_topk, layers=cfg.num_hidden_layers)
        if workload == "tiny":
            over.update(sinks=1, window=2)
        replay = batch_workload(preset(workload, **over), batch)         # request b: its own draw (seed)
    prompts = [torch.zeros(context, dtype=torch.int64)] * batch
    quest = {} if budget is None else {"token_budget": budget}
    dsa = dsa_formats(point)
    if point["mode"] == "hybrid":        # places the batch as `hybrid_batch` did, from the same budget
        dsa["kv_budget_gib"] = point["kv_budget_gib"]
    engine = Engine(model, point["mode"], cache_slots=point["cache_slots"], prefill="random",
                    prefetch=prefetch and point["mode"] == "hisparse", decode_backend=decode_backend, **quest, **dsa)
    replay = replay and with_anchors(replay, engine.anchors)
    out = engine.generate(prompts, generated_tokens(new_tokens, warmup_steps), graph=graph, keep_logits=False,
                          replay=replay, warmup_steps=warmup_steps)
    del engine
    release_cached_memory()          # the next point's host pool must fit beside nothing
    return out


def decode_rows(point: dict, out, batch: int) -> list[dict]:
    tpot = out.decode_s / max(out.timed_steps, 1)
    metrics = {"tokens_per_s": (batch / tpot, "tokens/s"), "tpot_ms": (tpot * 1e3, "ms"),
               "hbm_bytes_per_request": (out.kv_bytes_per_request, "bytes")}
    if out.step_ms:      # the median step, robust to a slow one (a clock change, a host hiccup)
        metrics["tpot_median_ms"] = (statistics.median(out.step_ms), "ms")
    if point["mode"] != "resident":
        metrics["miss_rate"] = (out.miss_rate, "fraction")
    return [dict(point, run=decode_runs, metric=m, value=v, unit=u) for m, (v, u) in metrics.items()]


def generated_tokens(new_tokens: int, warmup_steps: int) -> int:
    """Tokens a decode run generates: the prefill's, then the warm-up and the timed steps' ones."""
    return 1 + warmup_steps + new_tokens


def dsa_formats(point: dict) -> dict:
    """The DSA storage formats a point sets (kv_dtype, index_dtype), as keyword arguments."""
    return {key: point[key] for key in ("kv_dtype", "index_dtype") if point.get(key) is not None}


def row_bytes(cfg, elem: int, kv_dtype: str | None) -> int:
    """Bytes of one DSA latent row as stored: 512 + 64 values of `elem` bytes, or the fp8 row."""
    return ROW_BYTES if kv_dtype == "fp8" else (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem


def kv_bytes_per_request(model, mode: str, capacity: int, cache_slots: int | None,
                         kv_dtype: str | None = None, index_dtype: str | None = None) -> tuple[int, int]:
    """(GPU, host) bytes of one request's KV as the engine allocates it for `capacity` tokens (its
    prompt, the steps it decodes and one more: `run_decode`'s). DSA: latents resident, or B + 1 slots
    per layer with every latent on the host; plus the resident indexer keys of the layers that select.
    Quest: keys and values resident, or, in its Quest layers, B + 1 page slots per KV head with every
    page on the host; plus the page bounds (a min and a max key per page and KV head) of the dense
    layers and of the Quest layers that select. A hierarchical stream also holds its cache state (LRU
    order, slot marks, counters and a 4-byte slot map entry per unit: `CacheState`). Exactly what
    `Generation.kv_bytes_per_request` then measures (tests/test_sweep.py)."""
    cfg, elem = model.config, model.model.embed_tokens.weight.element_size()
    pages = -(-capacity // 16)

    def per_stream(units: int, row_bytes: int) -> int:     # slots and cache state of one stream
        return (cache_slots + 1) * row_bytes + nbytes(*vars(CacheState.empty(1, cache_slots, units, "meta")).values())

    if family(cfg) == "quest":
        hkv, d = cfg.num_key_value_heads, cfg.head_dim
        bounds = 2 * hkv * pages * d * elem                  # a layer's page min and max keys
        dense = cfg.quest_dense_layers
        quest = range(dense, cfg.num_hidden_layers)
        selecting = sum(1 for i in quest if cfg.selection_anchor(i) == i)
        gpu = dense * (2 * hkv * capacity * d * elem + bounds) + selecting * bounds
        page_row = 2 * 16 * d * elem
        if mode == "resident":
            return gpu + len(quest) * hkv * pages * page_row, 0
        return gpu + len(quest) * hkv * per_stream(pages, page_row), len(quest) * hkv * pages * page_row
    row = row_bytes(cfg, elem, kv_dtype)
    key = stored_index_bytes(cfg.index_head_dim, elem, index_dtype or "bf16")     # one token's indexer key
    index = sum(1 for t in cfg.indexer_types if t == "full") * capacity * key
    if mode == "resident":
        return cfg.num_hidden_layers * capacity * row + index, 0
    return cfg.num_hidden_layers * per_stream(capacity, row) + index, cfg.num_hidden_layers * capacity * row


def attention_kernel(model, backend: str = "auto", kv_dtype: str | None = None) -> str:
    """The sparse attention kernel the model's decode runs: for DSA the one `sparse_mla_decode` (over
    fp8 rows `sparse_mla_decode_fp8`) picks for its query shape, dtype, device and `backend` ("gluon"
    or "triton"; fp8 rows' say so by the kv_dtype column); "triton" for the other families."""
    cfg, weight = model.config, model.model.embed_tokens.weight
    if family(cfg) != "dsa":
        return "triton"
    q = torch.empty(1, cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=weight.dtype,
                    device=weight.device)
    return stored_decode_kernel(q, cfg.kv_lora_rank, kv_dtype or "bf16", backend)


def run_point(model, study: dict, point: dict, on_gpu: bool) -> list[dict]:
    cfg, elem = model.config, model.model.embed_tokens.weight.element_size()
    if point["family"] == "quest":      # a unit is a 16-token page of one KV head's keys and values
        k, unit_bytes = point["token_budget"] // 16, 2 * 16 * cfg.head_dim * elem
    else:
        k, unit_bytes = cfg.index_topk, row_bytes(cfg, elem, point.get("kv_dtype"))
    settings = run_settings(study, point, on_gpu)
    graph, prefetch, backend = settings["graph"], settings.get("prefetch", False), settings.get("decode_backend", "auto")
    point = dict(point, k=k, unit_bytes=unit_bytes, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                 **settings, attention_kernel=attention_kernel(model, backend, point.get("kv_dtype")))
    if point["bench"] == "serving":
        return run_serving(model, study, point)
    if point["bench"] == "decode":
        out = run_decode(model, point, point["batch"], study["new_tokens"], graph, prefetch, study["warmup_steps"],
                         decode_backend=backend)
        return decode_rows(point, out, point["batch"])
    capacity = point["context"] + generated_tokens(study["new_tokens"], study["warmup_steps"])   # as run_decode
    if point["mode"] == "hybrid":
        (batch, resident), (fits_gpu, _) = (hybrid_batch(model, study, point, capacity, gpu_only)
                                            for gpu_only in (False, True))
        per_request = kv_bytes_per_request(model, "hisparse", capacity, point["cache_slots"], point.get("kv_dtype"),
                                           point.get("index_dtype"))[1]
        host_bytes = (batch - resident) * per_request / max(batch, 1)
    else:
        batch, fits_gpu, host_bytes = largest_batch(model, study, point, point["mode"], capacity)
    caps = {"GPU budget": fits_gpu, "max lanes": study["max_batch"]}
    if point["mode"] != "resident" and "host_budget_gib" in study:    # hybrid: its hierarchical requests
        per_request = kv_bytes_per_request(model, "hisparse", capacity, point["cache_slots"], point.get("kv_dtype"),
                                           point.get("index_dtype"))[1]
        caps["host RAM"] = int(study["host_budget_gib"] * 2**30 // per_request)
    print(f"  throughput: batch {batch} at {point['context']} tokens, {cap_text(caps, batch)}"
          f"{ratio_text(point, batch)}", flush=True)
    row = dict(point, batch=batch)
    sizes = [dict(row, metric="max_batch", value=batch, unit="requests"),
             dict(row, metric="max_batch_gpu_budget", value=fits_gpu, unit="requests"),
             dict(row, metric="host_bytes_per_request", value=host_bytes, unit="bytes")]
    if point["mode"] == "hybrid":
        sizes.append(dict(row, metric="resident_requests", value=resident, unit="requests"))
    if batch < 1:
        return sizes
    out = run_decode(model, dict(point, batch=batch), batch, study["new_tokens"], graph,
                     warmup_steps=study["warmup_steps"])
    if point["mode"] == "hybrid" and out.resident_requests != resident:
        raise RuntimeError(f"the engine placed {out.resident_requests} of {batch} requests resident, "
                           f"hybrid_batch {resident}: the two must apply one rule")
    return sizes + decode_rows(row, out, batch)


admitted: dict[tuple, dict[str, int]] = {}     # each point's batch by mode, for the ratio to resident's


def cap_text(caps: dict[str, int], batch: int) -> str:
    """What caps an admitted batch, e.g. 'capped by the GPU budget (GPU budget 6, max lanes 256)': the
    caps that equal it (none for a hybrid batch that the two budgets bound together)."""
    binding = [f"the {name}" for name, n in caps.items() if n == batch] or ["the GPU and host budgets together"]
    return f"capped by {' and '.join(binding)} ({', '.join(f'{name} {n}' for name, n in caps.items())})"


def ratio_text(point: dict, batch: int) -> str:
    """'; 3.17x resident's 6' where the point's resident twin (the same but for mode, B and prefetch,
    which only hisparse takes) ran in this process; empty for resident and where it did not."""
    key = tuple(sorted((k, str(v)) for k, v in point.items() if k not in ("mode", "cache_slots", "prefetch")))
    seen = admitted.setdefault(key, {})
    seen[point["mode"]] = batch
    if point["mode"] == "resident" or not seen.get("resident"):
        return ""
    return f"; {batch / seen['resident']:.2f}x resident's {seen['resident']}"


def largest_batch(model, study: dict, point: dict, mode: str, capacity: int) -> tuple[int, int, int]:
    """(batch, batch by the GPU budget alone, host bytes per request) of resident, hisparse or noio: the
    most requests of `capacity` tokens whose KV (`kv_bytes_per_request`) fits the GPU budget, and the
    host budget where given, at most max_batch."""
    gpu_bytes, host_bytes = kv_bytes_per_request(model, mode, capacity, point["cache_slots"], point.get("kv_dtype"),
                                                 point.get("index_dtype"))
    fits_gpu = int(study["kv_budget_gib"] * 2**30 // gpu_bytes)
    fits = fits_gpu
    if host_bytes and "host_budget_gib" in study:
        fits = min(fits, int(study["host_budget_gib"] * 2**30 // host_bytes))
    return min(fits, study["max_batch"]), fits_gpu, host_bytes


def hybrid_batch(model, study: dict, point: dict, capacity: int, gpu_only: bool = False) -> tuple[int, int]:
    """(batch, resident requests) of mode hybrid (DSA) in the throughput study. The rule: hybrid's batch
    is the larger of resident's and hisparse's largest batch under the same budgets (`largest_batch`;
    gpu_only: the GPU budget alone, no host budget or max_batch), with as many requests
    resident as the GPU budget allows beside the hierarchical ones' fixed parts (their slots, cache
    state and slot maps: `DsaRuntime.hybrid_placement`, the engine's own), the rest hierarchical
    within the host budget. Bytes are as the engine allocates them (`DsaRuntime.hybrid_bytes`): a
    resident request holds what it holds in resident mode (its rows in a run of streams without cache
    state, rounded up to whole streams once per batch), a hierarchical one what it holds in hisparse.
    So at a short context, where resident's batch is the larger, it is resident's batch with every
    request resident (one fewer where that rounding, < B + 1 rows, does not fit beside it); at a long
    context hisparse's batch, the GPU budget hisparse leaves spare holding resident requests."""
    runtime = DsaRuntime(model, **dsa_formats(point))
    limits = study
    if gpu_only:
        limits = {key: value for key, value in study.items() if key != "host_budget_gib"}
        limits["max_batch"] = math.inf
    host_budget_gib = limits.get("host_budget_gib")
    batch = max(largest_batch(model, limits, point, mode, capacity)[0] for mode in ("resident", "hisparse"))
    budget = int(study["kv_budget_gib"] * 2**30)
    host_rows = None if host_budget_gib is None else int(host_budget_gib * 2**30 // runtime.row_bytes)
    while batch >= 1:
        resident = runtime.hybrid_placement(batch, capacity, point["cache_slots"], budget, host_rows)
        if resident is not None:
            return batch, resident
        batch -= 1
    return 0, 0



# -- serving ---------------------------------------------------------------------------------

def validate_serving(study: dict, where: str) -> None:
    """A serving study's own keys: lengths, load (concurrency or rates), counts."""
    for key in ("input_len", "output_len"):
        _positive_int(study, key, where)
    loads = [key for key in ("concurrency", "rates", "request_rate", "conversations") if key in study]
    if study.get("dataset", "random") != "random":
        pass                                    # expand_dataset checked its load
    elif len(loads) != 1:
        raise ConfigError(f"{where}: give concurrency (closed loop), rates (open loop) or request_rate "
                          f"(bench_serving's random dataset), one of them"
                          + (f"; this study gives {loads}" if loads else ""))
    stray = [key for key in DIALECT_KEYS if key in study and "request_rate" not in study]
    if stray:
        raise ConfigError(f"{where}: {stray[0]} = {study[stray[0]]!r} belongs to a request_rate study (bench_serving's "
                          f"random dataset); this one gives {loads[0]}")
    if "request_rate" in study:
        validate_request_rate(study, where)
    elif "conversations" in study:
        study["conversations"] = _positive_ints(study, "conversations", where)
    elif "concurrency" in study:
        study["concurrency"] = _positive_ints(study, "concurrency", where)
        study.setdefault("requests_per_client", DEFAULTS["requests_per_client"])
        _positive_int(study, "requests_per_client", where)
    else:
        rates = study["rates"] if isinstance(study["rates"], list) else [study["rates"]]
        if not rates or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                                for r in rates):
            raise ConfigError(f"{where}: rates = {study['rates']!r}: expected a positive number of requests/s or "
                              f"a list of them")
        _listed_once(rates, "rates", where)
        study["rates"] = rates
        study.setdefault("requests", DEFAULTS["requests"])
        _positive_int(study, "requests", where)
    study.setdefault("max_batch", DEFAULTS["max_batch"])
    _positive_int(study, "max_batch", where)
    study.setdefault("prefill_chunk", DEFAULTS["prefill_chunk"])
    study["prefill_chunk"] = _positive_ints(study, "prefill_chunk", where)
    overlap = _switches(study, "prefill_overlap", where)
    if True in overlap and family(model_config(study)) != "dsa":
        raise ConfigError(f"{where}: prefill_overlap = true is built for DSA models; model {study['model']!r} "
                          f"is {family(model_config(study))}")
    study["prefill_overlap"] = overlap
    disaggregated = _switches(study, "disaggregated", where)
    if True in disaggregated and True in overlap:
        raise ConfigError(f"{where}: disaggregated = true prefills off the decode GPU's clock; prefill_overlap = true "
                          f"(beside the decode steps) does not apply to it: run them as two studies")
    study["disaggregated"] = disaggregated
    sharing = _switches(study, "prefix_cache", where)
    if True in sharing and True in disaggregated:
        raise ConfigError(f"{where}: prefix_cache = true caches prefixes on the server that prefills; disaggregated = "
                          f"true prefills every prompt off the clock, as its workers would (they keep no cache): "
                          f"run them as two studies")
    study["prefix_cache"] = sharing
    for key, what in (("prefill_layers", "sizes the pieces"), ("prefill_sms", "confines the pieces")):
        if key in study:
            _positive_int(study, key, where)
            if True not in overlap:
                raise ConfigError(f"{where}: {key} = {study[key]!r} {what} of prefill_overlap = true points, "
                                  f"and this study has none")
    slots = study.get("cache_slots")
    if isinstance(slots, list) and len(slots) != 1:
        raise ConfigError(f"{where}: cache_slots = {slots!r}: a serving study takes one B")


def expand_dataset(study: dict, where: str) -> None:
    """A serving study's dataset (`DATASETS`): its own keys present and no other dataset's; a multiturn
    or shared_document study's input_len derived, its longest prompt (a given one must equal it)."""
    dataset = study.get("dataset", "random")
    if dataset not in DATASETS:
        raise ConfigError(f"{where}: dataset = {dataset!r}: expected one of {DATASETS}")
    own = DATASET_KEYS.get(dataset, ())
    for other, keys in DATASET_KEYS.items():
        for key in keys:
            if key in study and key not in own:
                raise ConfigError(f"{where}: {key} = {study[key]!r} belongs to a dataset = {other!r} study; this "
                                  f"one is {dataset!r}")
    needed = ("input_len",) if dataset == "random" else (*own, "output_len")
    missing = [key for key in needed if key not in study]
    if missing:
        raise ConfigError(f"{where}: missing key {missing[0]!r} (dataset = {dataset!r})")
    if dataset == "random":
        return
    load = {"multiturn": "conversations", "shared_document": "request_rate"}[dataset]
    for key in ("concurrency", "rates", "request_rate", "requests_per_client", "requests"):
        if key in study and key != load:
            raise ConfigError(f"{where}: {key} = {study[key]!r}: a dataset = {dataset!r} study's load is {load} "
                              + ("(one closed-loop client per conversation, its turns in order)"
                                 if dataset == "multiturn" else "(Poisson arrivals of its num_prompts questions)"))
    if load not in study:
        raise ConfigError(f"{where}: missing key {load!r} (dataset = {dataset!r}: its load)")
    for key in (*own, "output_len"):
        if key != "conversations":
            _positive_int(study, key, where)
    if dataset == "multiturn":
        longest = study["first_len"] + (study["turns"] - 1) * (study["output_len"] + study["user_len"])
    else:
        if study.get("range_ratio", 1) != 1:
            raise ConfigError(f"{where}: range_ratio = {study['range_ratio']!r}: a shared_document study's lengths "
                              f"are fixed (document_len, question_len, output_len)")
        longest = study["document_len"] + study["question_len"]
    if study.get("input_len", longest) != longest:
        raise ConfigError(f"{where}: input_len = {study['input_len']!r}: a dataset = {dataset!r} study's input_len is "
                          f"its longest prompt, {longest}: drop it")
    study["input_len"] = longest


def validate_request_rate(study: dict, where: str) -> None:
    """A request_rate study's keys, as RandomWorkload checks them (its errors name the key)."""
    rates = study["request_rate"] if isinstance(study["request_rate"], list) else [study["request_rate"]]
    if not rates or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and not math.isnan(r) and r > 0
                            for r in rates):
        raise ConfigError(f"{where}: request_rate = {study['request_rate']!r}: expected a positive number of "
                          f"requests/s (or inf: every request at once), or a list of them")
    _listed_once(rates, "request_rate", where)
    study["request_rate"] = rates
    for key in ("num_prompts", "range_ratio", "seed"):
        study.setdefault(key, DEFAULTS[key])
    try:
        for rate in rates:
            RandomWorkload(study["input_len"], study["output_len"], study["num_prompts"], study["range_ratio"], rate,
                           study.get("max_concurrency"), study["seed"])
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if study.get("workload", "model") != "model" and study["range_ratio"] != 1:
        raise ConfigError(f"{where}: range_ratio = {study['range_ratio']!r} with workload = {study['workload']!r}: a "
                          f"preset's draws are made for input_len prompt and output_len output tokens; take "
                          f"range_ratio = 1 or workload = 'model'")


def serving_points(study: dict, base: dict, slots: list) -> list[dict]:
    """One point per load level (concurrency or rate), prefill chunk, prefill overlap and mode, the
    modes of a level, chunk and overlap back to back. An overlapped point carries prefill_overlap=True,
    a disaggregated one disaggregated=True;
    the others leave it out (their rows, as before the key existed, leave the column empty), and
    prefill_layers where it is not the Server's default, prefill_sms where set. A closed-loop point
    carries requests_per_client where it is not the default 2 (e.g. a longer run of the same level).
    A request_rate point leaves concurrency and rate empty and carries request_rate, num_prompts,
    range_ratio, max_concurrency and seed (the other points leave them out). A multiturn or
    shared_document point carries dataset and its keys (a multiturn one its conversations, concurrency
    and rate empty); a random one leaves them out."""
    layers = study.get("prefill_layers", PREFILL_LAYERS)
    overlapped = {"prefill_overlap": True, **({"prefill_layers": layers} if layers != PREFILL_LAYERS else {}),
                  **({"prefill_sms": study["prefill_sms"]} if "prefill_sms" in study else {})}
    loads = [("concurrency", c) for c in study.get("concurrency", [])] + [("rate", r) for r in study.get("rates", [])] \
        + [("request_rate", r) for r in study.get("request_rate", [])] \
        + [("conversations", c) for c in study.get("conversations", [])]
    dataset = study.get("dataset", "random")
    shared = {} if dataset == "random" else \
        {"dataset": dataset, **{key: study[key] for key in DATASET_KEYS[dataset] if key != "conversations"}}
    dialect = {key: study.get(key) for key in DIALECT_KEYS}
    per_client = study.get("requests_per_client", DEFAULTS["requests_per_client"])
    not_two = {} if per_client == DEFAULTS["requests_per_client"] else {"requests_per_client": per_client}
    out = []
    for (key, level), chunk, overlap, apart, sharing, mode in itertools.product(
            loads, study["prefill_chunk"], study["prefill_overlap"], study["disaggregated"], study["prefix_cache"],
            study["modes"]):
        out.append(dict(base, bench="serving", mode=mode, context=study["input_len"], input_len=study["input_len"],
                        output_len=study["output_len"], concurrency=level if key == "concurrency" else None,
                        rate=level if key == "rate" else None, cache_slots=slots[0] if mode != "resident" else None,
                        kv_budget_gib=study["kv_budget_gib"], host_budget_gib=study.get("host_budget_gib"),
                        prefill_chunk=chunk, **(overlapped if overlap else {}),
                        **({"disaggregated": True} if apart else {}), **({"prefix_cache": True} if sharing else {}),
                        **(not_two if key == "concurrency" else {}),
                        **(dict(request_rate=level, **dialect) if key == "request_rate" else {}),
                        **shared, **({"conversations": level} if key == "conversations" else {})))
    return out


def turn_metrics(run, conversations: int, row_bytes: int) -> dict[str, float]:
    """A multiturn run's per turn t (from 1): `ttft_ms_p50_turn{t}`, its requests' p50 TTFT, and
    `host_gib_turn{t}`, the host pool's peak bytes in use while they ran (from the first's arrival to
    the last's last token; other conversations' turns running beside them count too)."""
    out = {}
    for t in range(1, len(run.requests) // conversations + 1):
        reqs = run.requests[(t - 1) * conversations:t * conversations]       # (requests come turn-major)
        out[f"ttft_ms_p50_turn{t}"] = percentile([r.ttft for r in reqs], 50) * 1e3
        end = max(r.token_times[-1] for r in reqs)
        out[f"host_gib_turn{t}"] = run.host_bytes_peak(min(r.arrival for r in reqs), end) / GIB
    return out


def run_serving(model, study: dict, point: dict) -> list[dict]:
    """One serving run: the server sized by the budgets (and, in a closed loop, at most C lanes: C
    clients never have more requests out), its summary and sizes as rows."""
    global decode_runs
    decode_runs += 1                 # one decode graph captured (results/notes/graphs.md)
    reqs, clients = serving_requests(study, point, model.config.vocab_size)
    selections = None
    if point["workload"] != "model" and point.get("dataset") is not None:   # a draw per request at its length
        attach_selections(reqs, point["workload"], model.config, cache=draw_cache)
        selections = reqs[0].selections
    elif point["workload"] != "model":             # every request replays its own draw
        draws = request_draws(point["workload"], model.config, point["input_len"], point["output_len"], len(reqs),
                              cache=draw_cache)
        for r, draw in zip(reqs, draws, strict=True):
            r.selections = draw
        selections = draws[0]                    # sizes the server's replay buffer
    cap = clients or point.get("max_concurrency")        # never more requests out than this: no more lanes
    max_batch = min(study["max_batch"], cap) if cap else study["max_batch"]
    quest = {} if point.get("token_budget") is None else {"token_budget": point["token_budget"]}
    server = Server(model, point["mode"], cache_slots=point["cache_slots"],
                    max_context=point["input_len"] + point["output_len"], kv_budget_gib=point["kv_budget_gib"],
                    host_budget_gib=point["host_budget_gib"], max_batch=max_batch,
                    prefill_chunk=point["prefill_chunk"], graph=point["graph"],
                    decode_backend=point.get("decode_backend", "auto"), selections=selections, **quest,
                    prefill_overlap=point.get("prefill_overlap", False),
                    prefill_layers=point.get("prefill_layers", PREFILL_LAYERS), prefill_sms=point.get("prefill_sms"),
                    disaggregated=point.get("disaggregated", False), prefix_cache=point.get("prefix_cache", False),
                    **dsa_formats(point))
    caps = server.lane_caps
    batch = min(caps.values())
    print(f"  serving: {server.lanes} lanes of {server.lane_bytes / GIB:.3f} GiB, a prefill workspace of "
          f"{server.workspace_bytes / GIB:.3f} GiB, under {point['kv_budget_gib']} GiB; admits {batch}, "
          f"{cap_text(caps, batch)}{ratio_text(point, batch)}", flush=True)
    warm_key = (point["input_len"], point["prefill_chunk"], point["mode"], point.get("kv_dtype"),
                point.get("index_dtype"))
    if warm_key not in serving_warmed:    # a process's first prompt of a shape compiles kernels (7 s at 16K
        warm = Request(reqs[0].prompt.clone(), min(2, point["output_len"]),    # on the H200): one untimed
                       selections=reqs[0].selections)
        server.serve([warm])
        serving_warmed.add(warm_key)
        if server.sharing is not None:           # the warm-up's pages are not the point's to hit
            server.sharing.index.clear()
    run = server.serve(reqs, clients=clients, progress=True, max_concurrency=point.get("max_concurrency"))
    summary = run.summary()
    if point.get("request_rate") is not None:            # the dialect's figures beside the percentiles
        dialect = benchmark_summary(run.requests, min(r.arrival for r in run.requests),
                                    sum(len(r.prompt) for r in run.requests))
        summary.update({m: dialect[m] for m in DIALECT_METRICS})
    if point.get("dataset") == "multiturn":              # turns 2 and later: what a prefix cache serves
        later = run.requests[point["conversations"]:]      # (requests come turn-major)
        for q in (50, 99):
            summary[f"ttft_ms_p{q}_later_turns"] = percentile([r.ttft for r in later], q) * 1e3
        summary.update(turn_metrics(run, point["conversations"], server.runtime.row_bytes))
    hits, misses = sum(r.hits for r in run.requests), sum(r.misses for r in run.requests)
    units = {"tokens_per_s": "tokens/s", "requests": "requests", "output_tokens": "tokens",
             "running_batch_mean": "requests", "running_batch_max": "requests",
             "resident_admissions": "requests", "demotions": "requests", "resident_steps": "steps",
             "request_throughput": "requests/s", "input_throughput": "tokens/s", "prefix_prompt_tokens": "tokens",
             "prefix_hit_tokens": "tokens", "prefill_tokens": "tokens", "prefix_hit_rate": "fraction",
             "prefix_cached_pages": "pages", **{m: "GiB" for m in summary if m.startswith("host_gib_turn")}}
    rows = [dict(point, metric=m, value=v, unit=units.get(m, "ms")) for m, v in summary.items()]
    rows += [dict(point, metric="lanes", value=server.lanes, unit="requests"),
             dict(point, metric="peak_gpu_gib", value=run.peak_gpu_bytes / GIB, unit="GiB"),
             dict(point, metric="peak_host_gib", value=run.host_bytes_peak() / GIB, unit="GiB"),
             dict(point, metric="wall_s", value=run.wall_s, unit="s")]
    if point["mode"] != "resident":
        rows.append(dict(point, metric="miss_rate", value=misses / max(1, hits + misses), unit="fraction"))
    decode_runs += max(0, server.graphs_captured - 1)
    del server
    release_cached_memory()
    return [dict(row, batch=None, run=decode_runs) for row in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, epilog=keys_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="sweep config (TOML); default: %(default)s")
    ap.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    ap.add_argument("--force", action="store_true", help="rerun points already in the results")
    ap.add_argument("--dry-run", action="store_true", help="validate and list the points, run nothing")
    ap.add_argument("--kind", choices=sorted(KEYS), action="append",
                    help="run only the studies of this kind (repeatable; default: every study)")
    ap.add_argument("--runs-per-process", type=int, default=None, metavar="N",
                    help="after N decode runs (N graphs: a graphed hybrid serving run counts 2), go on in a fresh process (the sweep resumes where it stopped): on "
                         "the H200, once PyTorch has captured 4 CUDA graphs in a process, its graphs replay "
                         "slower, so the 4th decode run and every later one take about 11%% longer per step "
                         "(results/notes/graphs.md), so N <= 3 keeps every run on the fast side; command "
                         "line only, not with --force")
    ap.add_argument("--draw-cache", type=Path, default=None, metavar="DIR",
                    help="keep each serving request's synthetic selections in DIR (one .npy file per request: "
                         "output_len x layers x k int32, 0.5 GB at DSA's 61 layers and 1K tokens out) and reuse "
                         "them in later points and processes instead of drawing them again (tens of seconds each)")
    ap.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                    help="run only the points whose KEY is VALUE, as the dry run lists them, or one of VALUE,VALUE "
                         "(repeatable, all must hold; e.g. --only mode=hisparse --only concurrency=6,8; a point "
                         "without KEY has the value None): a part of a config that fits one GPU call, its points in "
                         "one process (the model built once); a VALUE no point has is an error")
    ap.add_argument("--draw-only", action="store_true",
                    help="with --draw-cache: draw the selections the points to run will read into DIR, run no "
                         "point (on a GPU machine, beside the GPU tests: the draws take the host's cores, "
                         "1.5-3 minutes for h200_serving.toml's 16 requests on the H200's 16 cores)")
    args = ap.parse_args(argv)
    if args.draw_only and args.draw_cache is None:
        ap.error("--draw-only fills the draw cache: name it with --draw-cache DIR")
    only = []
    for item in args.only:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--only {item!r}: expected KEY=VALUE, e.g. mode=hisparse")
        only.append((key, value.split(",")))
    global draw_cache
    draw_cache = args.draw_cache
    if args.runs_per_process is not None:
        if args.runs_per_process < 1:
            ap.error(f"--runs-per-process {args.runs_per_process}: expected a positive integer")
        if args.force:
            ap.error("--runs-per-process resumes in a fresh process, which --force would start over: run the "
                     "points to redo into a new --out instead")
        if argv is not None:
            ap.error("--runs-per-process replaces the running process: use it from the command line")
    try:
        config = tomllib.loads(utf8_text(Path(args.config), "a TOML file"))
        if set(config) - {"study"}:
            raise ConfigError(f"unknown top-level key {sorted(set(config) - {'study'})[0]!r}: a config holds "
                              f"only [[study]] tables")
        studies = config.get("study", [])
        validate(studies)
        if args.kind:
            studies = [s for s in studies if s["kind"] in args.kind]
            if not studies:
                raise ConfigError(f"no study of kind {args.kind} in the config")
    except (OSError, tomllib.TOMLDecodeError, ConfigError) as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for study in studies:                    # before anything runs: a Gluon kernel that cannot run here
        if study.get("decode_backend") == "gluon":
            cfg = model_config(study)
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            probe = torch.empty(1, cfg["num_attention_heads"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
                                dtype=dtype, device=device)
            try:                             # the bf16 rows' Gluon kernel, or the fp8 rows' one
                stored_decode_kernel(probe, cfg["kv_lora_rank"], study.get("kv_dtype", "bf16"), "gluon")
            except ValueError as exc:
                print(f"error: {args.config}: study {study.get('_index', '')}: decode_backend = \"gluon\" cannot run "
                      f"here: {exc}", file=sys.stderr)
                return 2
    gpu, out_dir = environment()["gpu"], Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        print(f"error: --out {out_dir} is a file, not a folder for the result CSVs", file=sys.stderr)
        return 2
    timed = sorted({points(s)[0]["bench"] for s in studies} - set(HOST_BENCHES))
    why = cpu_rows_refused(out_dir, gpu, timed[0]) if timed else None
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    todo, rerun = [], 0                 # rerun: points stored, but run another way than the config asks
    on_gpu = device.type == "cuda"
    try:
        for study in studies:
            done = done_points(out_dir / f"{points(study)[0]['bench']}.csv")
            for point in points(study):
                if args.force or not already_done(done, point, gpu, run_settings(study, point, on_gpu)):
                    todo.append((study, point))
                    rerun += not args.force and already_done(done, point, gpu)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    every = [p for s in studies for p in points(s)]
    known = set().union(*every)
    for key, values in only:
        if key not in known:
            print(f"error: --only {key}=...: no point has the key {key!r}; its points have {sorted(known)}",
                  file=sys.stderr)
            return 2
        present = {str(p.get(key)) for p in every}        # a point without the key lists it as None
        if not present & set(values):                     # a typo would otherwise run nothing, silently
            print(f"error: --only {key}={','.join(values)}: no point has {key} {' or '.join(values)}; its points "
                  f"have {', '.join(sorted(present, key=_natural))}", file=sys.stderr)
            return 2
    pending = len(todo)
    todo = [(study, point) for study, point in todo if all(str(point.get(k)) in v for k, v in only)]
    keys = [tuple(sorted((k, str(v)) for k, v in point.items())) for _, point in todo]
    if args.runs_per_process and len(set(keys)) < len(keys):
        print("error: two studies share a point (they differ only in how it runs: new_tokens, warmup_steps, "
              "graph, prefetch or decode_backend), which a resumed process would run once: split them into two configs "
              "for --runs-per-process", file=sys.stderr)
        return 2
    total = sum(len(points(s)) for s in studies)
    where = out_note(out_dir)
    print(f"{args.config}: {total} points, {total - pending} already in {out_dir}/{where}, {pending} to run on {gpu}"
          + (f" ({rerun} of them stored from runs made another way, in new_tokens, warmup_steps, graph, prefetch "
             f"or decode_backend: they run again, and the figures read a point's newest rows)" if rerun else "")
          + (f"; --only {' '.join(k + '=' + ','.join(v) for k, v in only)}: {len(todo)} of them" if only else ""))
    if args.dry_run:
        for study, point in todo:
            print("  ", point)
        return 0
    if draw_cache is not None:         # every draw the serving points will read, drawn side by side now
        needs = {}
        for study, point in todo:
            if point["bench"] == "serving" and point["workload"] != "model":
                groups = {(point["input_len"], point["output_len"]): serving_request_count(study, point)} \
                    if point.get("dataset") is None else point_workload(study, point).length_groups()
                for (input_len, output_len), count in groups.items():
                    shape = (point["workload"], study["model"], study.get("layers"), study.get("hidden"),
                             input_len, output_len)
                    needs[shape] = (study, max(count, needs.get(shape, (None, 0))[1]))
        for (workload, *_, input_len, output_len), (study, count) in needs.items():
            config = config_from_dict(model_config(study))
            fill_draw_cache(workload, config, input_len, output_len, count, draw_cache)
    if args.draw_only:
        print(f"draws of {sum(c for _, c in needs.values())} requests in {draw_cache}/; no point run (--draw-only)")
        return 0
    start, models = time.perf_counter(), {}
    for i, (study, point) in enumerate(todo):
        t0 = time.perf_counter()
        if point["bench"] == "policies":
            rows = policy_study(preset(point["workload"]), point["workload"], calibrated=False)
        else:
            key = (study["model"], study.get("layers"), study.get("hidden"))
            if key not in models:
                models.clear()
                models[key] = build(study, device)
            rows = run_point(models[key], study, point, on_gpu)
        append_rows(out_dir / f"{point['bench']}.csv", rows)
        elapsed = time.perf_counter() - start
        eta = elapsed / (i + 1) * (len(todo) - i - 1)
        shown = {k: v for k, v in point.items() if k not in ("bench", "family") and v is not None}
        print(f"[{i + 1}/{len(todo)}] {point['bench']} {shown}: {time.perf_counter() - t0:.1f} s "
              f"(elapsed {elapsed:.0f} s, about {eta:.0f} s left)", flush=True)
        if args.runs_per_process and i + 1 < len(todo) and \
                over_limit(decode_runs, *todo[i + 1], on_gpu, args.runs_per_process):
            print(f"{decode_runs} decode runs in this process: going on in a fresh one", flush=True)
            sys.stderr.flush()
            os.execv(sys.executable, [sys.executable, "-m", "experiments.sweep", *sys.argv[1:]])
    print(f"done: rows appended under {out_dir}/{where}; draw figures with python -m experiments.figures "
          f"--results {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

