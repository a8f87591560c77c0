"""The serving study's requests, one definition for the in-process study (experiments.sweep) and
the HTTP load client (hisparse.serve.bench), so a row from one sits beside its twin from the other:
random prompts seeded per request (the same in every mode), a closed loop's clients or an open
loop's Poisson arrivals (seeded).
"""
from __future__ import annotations

import torch

from hisparse.serving.request import Request

REQUESTS_PER_CLIENT = 2            # a closed loop's default: requests each client sends


def serving_request_count(study: dict, point: dict) -> int:
    """Requests of a serving point: requests_per_client per client, or `requests` (open loop)."""
    closed = point["concurrency"] is not None
    return point["concurrency"] * study["requests_per_client"] if closed else study["requests"]


def serving_requests(study: dict, point: dict, vocab: int) -> tuple[list[Request], int | None]:
    """The point's requests (random prompts, seeded per request: the same in every mode) and its
    client count (None: Poisson arrivals at the rate, seeded)."""
    closed = point["concurrency"] is not None
    count = serving_request_count(study, point)
    gen = torch.Generator().manual_seed(0)
    arrivals = torch.zeros(count) if closed else torch.empty(count).exponential_(generator=gen).cumsum(0) / point["rate"]
    reqs = []
    for i in range(count):
        prompt = torch.randint(0, vocab, (point["input_len"],), generator=torch.Generator().manual_seed(1000 + i))
        reqs.append(Request(prompt, point["output_len"], arrival=float(arrivals[i])))
    return reqs, point["concurrency"]
