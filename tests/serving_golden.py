"""Fixed serving schedules whose outcome is pinned in tests/golden/serving.json: every family, modes
resident, hisparse and hybrid (and DSA's prefill beside decode), tiny models in the interpreter. Each
run chooses its own schedule; the file keeps, per request, its tokens, hits, misses and a hash of
its logits' bytes, and the schedule, sizes and peaks the server chose (the same as the single-module
Server's before the serving package: checked for every case but hybrid's when the fields were added). tests/test_serving_golden.py reproduces them bitwise.

    python tests/serving_golden.py        # rewrite the file (only on purpose: it pins behaviour)
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_serving import MAX_CONTEXT, QUICK, SETTINGS, requests, tiny  # noqa: E402
from test_serving_hybrid import HYBRID, hybrid_server, model_of  # noqa: E402

from hisparse.serving import Request, Server  # noqa: E402

GOLDEN = pathlib.Path(__file__).parent / "golden" / "serving.json"
# (family, mode, extra server settings): each a closed loop of 3 clients over 5 requests
CASES = [(family, mode, {}) for family in SETTINGS for mode in ("resident", "hisparse", "hybrid")] + [
    ("deepseek_v32", "hisparse", {"prefill_overlap": True, "prefill_layers": 1})]


def case_name(family: str, mode: str, extra: dict) -> str:
    return "/".join([family, mode, *(f"{k}={v}" for k, v in sorted(extra.items()))])


def run_case(family: str, mode: str, extra: dict) -> dict:
    """One case's run: {"schedule": [...], "requests": [{"tokens", "logits_sha256"}, ...]}."""
    kw = dict(SETTINGS[family], prefill_chunk=24, keep_logits=True, **QUICK, **extra)
    reqs = requests(seed=7, n=5)
    if family == "nsa":                           # its interpreter decode step is the slowest
        reqs = [Request(r.prompt, min(r.max_new_tokens, 3)) for r in reqs]
    if mode == "hybrid":
        settings, extra_runs, max_context = HYBRID["llama-shared" if family == "llama" else family]
        kw.update(settings)
        server = hybrid_server(model_of("llama-shared" if family == "llama" else family), extra_runs=extra_runs,
                               max_context=max_context, **kw)
    else:
        if mode == "resident":
            kw.pop("cache_slots")
        server = Server(tiny(family), mode, max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3, **kw)
    run = server.serve(reqs, clients=3)
    return {"lanes": server.lanes, "lane_bytes": server.lane_bytes, "workspace_bytes": server.workspace_bytes,
            "peak_gpu_bytes": run.peak_gpu_bytes, "peak_host_rows": run.peak_host_rows, "hybrid": run.hybrid,
            "schedule": [[it.admitted, it.prefilled, int(it.decoded), list(it.layers) if it.layers else None,
                          int(it.joined)] for it in run.schedule.iterations],
            "requests": [{"tokens": r.tokens, "hits": r.hits, "misses": r.misses,
                          "logits_sha256": hashlib.sha256(b"".join(x.numpy().tobytes() for x in r.logits)).hexdigest()}
                         for r in run.requests]}


def main() -> None:
    torch.set_num_threads(1)                      # one thread's reductions, as the test's worker
    out = {case_name(*case): run_case(*case) for case in CASES}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(out)} runs to {GOLDEN}")


if __name__ == "__main__":
    main()
