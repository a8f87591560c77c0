"""Serving's behaviour pinned: the fixed schedules of tests/serving_golden.py (every family; resident,
hisparse, hybrid, DSA's prefill beside decode) choose the same schedule and give every request the
same tokens and bitwise the same logits as when tests/golden/serving.json was written."""
import json

import pytest
import torch
from serving_golden import CASES, GOLDEN, case_name, run_case


@pytest.mark.skipif(torch.cuda.is_available(), reason="the golden hashes are the interpreter's logits on the CPU; "
                    "on a GPU the serving GPU tests check resident == hisparse == hybrid bitwise")
@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_serving_reproduces_its_golden_run(case):
    expected = json.loads(GOLDEN.read_text())[case_name(*case)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # as the file was written: one thread's reductions
    try:
        got = run_case(*case)
    finally:
        torch.set_num_threads(threads)
    for key in ("lanes", "lane_bytes", "workspace_bytes", "peak_gpu_bytes", "peak_host_rows", "hybrid"):
        assert got[key] == expected[key], key
    assert got["schedule"] == expected["schedule"], "the server chose another schedule"
    for n, (a, b) in enumerate(zip(got["requests"], expected["requests"], strict=True)):
        assert (a["tokens"], a["hits"], a["misses"]) == (b["tokens"], b["hits"], b["misses"]), f"request {n}"
        assert a["logits_sha256"] == b["logits_sha256"], f"request {n}: logits differ"
