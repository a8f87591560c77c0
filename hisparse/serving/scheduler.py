"""Who runs next: the queues, admission order and the prefill chunk budget, in plain Python over sizes.

Requests wait in two queues: `pending`, submitted with an arrival still to come (by arrival time),
and `waiting`, arrived and not admitted (first come, first served). The head of `waiting` is
admitted when nothing is being prefilled, a lane is free and the memory says it fits
(`LaneMemory.admissible`). A prefill advances one piece an iteration: a chunk of at most
`prefill_chunk` prompt tokens through every layer, or, with prefill beside decode, `piece_layers`
layers of it at a time. `drive` runs a list of requests through a server (`Server.serve`); the rest
is plain Python over sizes.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

from hisparse.host_pool import as_int
from hisparse.serving.request import Iteration, Request


class Scheduler:
    def __init__(self, prefill_chunk: int, piece_layers: int, layers: int):
        self.prefill_chunk, self.piece_layers, self.layers = prefill_chunk, piece_layers, layers
        self.pending: list[Request] = []        # submitted with an arrival still to come
        self.waiting: list[Request] = []        # arrived, not admitted, first come first served

    def add(self, request: Request) -> None:
        self.pending.append(request)
        self.pending.sort(key=lambda r: (r.arrival, r.rid))

    def arrive(self, now: float) -> None:
        """Arrivals up to `now` join the waiting queue."""
        while self.pending and self.pending[0].arrival <= now:
            self.waiting.append(self.pending.pop(0))

    def next_arrival(self) -> float | None:
        return self.pending[0].arrival if self.pending else None

    def queued(self, request: Request) -> bool:
        return request in self.waiting or request in self.pending

    def remove(self, request: Request) -> bool:
        """Take a request out of whichever queue holds it; False if none does."""
        for queue in (self.waiting, self.pending):
            if request in queue:
                queue.remove(request)
                return True
        return False

    def admit(self, fits: Callable[[Request], bool]) -> Request | None:
        """The head of the waiting queue, taken out, if `fits` says it can be placed now."""
        if self.waiting and fits(self.waiting[0]):
            return self.waiting.pop(0)
        return None

    def next_piece(self, prompt: int, done: int, chunk: int, layer: int) -> tuple[int, int, int]:
        """(chunk tokens, first layer, end layer) of a prefill's next piece: the rest of the chunk
        under way (`layer` > 0: `chunk` tokens from layer `layer`), else a new chunk from token `done`."""
        if not layer:
            chunk = min(self.prefill_chunk, prompt - done)
        return chunk, layer, min(layer + self.piece_layers, self.layers)

    def planned_piece(self, plan: Iteration, chunk: int, layer: int, under_way: bool) -> tuple[int, int, int] | None:
        """A replayed schedule's piece, checked to follow the prefill under way (`under_way`: one is,
        `chunk` tokens, `layer` layers of it done)."""
        if not plan.prefilled:
            return None
        lo, hi = plan.layers if plan.layers is not None else (0, self.layers)
        if not under_way or lo != layer or (lo > 0 and plan.prefilled != chunk) or not lo < hi <= self.layers:
            raise ValueError(f"the replayed schedule's prefill piece ({plan.prefilled} tokens, layers {lo}.."
                             f"{hi - 1}) does not follow the prefill under way")
        return plan.prefilled, lo, hi


def free_lane(lane_request: list[Request | None], reserved: int | None) -> int | None:
    """The lowest lane neither running a request nor reserved for the one being prefilled."""
    return next((i for i, r in enumerate(lane_request) if r is None and i != reserved), None)


def drive(server, requests: list[Request], clients: int | None, replay, progress: bool,
          max_concurrency: int | None = None):
    """`Server.serve`: every request checked, a run opened (following `replay`, a schedule, if given),
    requests submitted and the server stepped until each finished: a closed loop of `clients` (request
    i sent by client i % clients once its previous one finished), or each at its arrival (clients
    None), capped at `max_concurrency` out at once if given (request i sent at the later of its arrival
    and the end of one of them: bench_serving's semaphore), sleeping while nothing runs until the next
    one; the run closed (on an error, its requests cancelled). progress: a line every 10 s. Returns the
    run, its requests in the caller's order."""
    if max_concurrency is not None:
        if clients is not None:
            raise ValueError(f"max_concurrency = {max_concurrency!r} caps an open loop; a closed loop of "
                             f"clients = {clients!r} has at most that many out already: give one of them")
        max_concurrency = as_int(max_concurrency, "max_concurrency must be an int >= 1", 1)
    seen = {}
    for i, r in enumerate(requests):          # every request checked before anything runs
        if seen.setdefault(id(r), i) != i:
            raise ValueError(f"serve() got one Request object twice (at {seen[id(r)]} and {i}): each needs its own")
        server.check_request(r)
    if clients is not None:
        clients = as_int(clients, "clients must be an int >= 1", 1)
        for i, r in enumerate(requests):
            r.client = i % clients
    server.open(replay)
    try:
        _loop(server, requests, clients, progress, max_concurrency)
        run = server.close()
    except BaseException as error:
        if server.is_open:
            try:
                server.close("cancel")
            except Exception as cleanup:        # the first error is the one to see
                error.add_note(f"closing the run then failed too: {cleanup!r}")
        raise
    run.requests = list(requests)
    return run


def _loop(server, requests: list[Request], clients: int | None, progress: bool, max_concurrency: int | None) -> None:
    cap = clients if clients is not None else max_concurrency
    for r in requests if cap is None else requests[:cap]:
        server.submit(r)
    place = {id(r): i for i, r in enumerate(requests)}
    sent = len(requests) if cap is None else min(cap, len(requests))
    done, last_progress = 0, time.perf_counter()
    while done < len(requests):
        for r in server.step():
            done += 1
            if clients is not None and place[id(r)] + clients < len(requests):   # the client's next, now
                nxt = requests[place[id(r)] + clients]
                nxt.arrival = r.token_times[-1] + nxt.think_time
                server.submit(nxt)
            elif clients is None and sent < len(requests):     # (capped) the next in line, once it arrives
                requests[sent].arrival = max(requests[sent].arrival, r.token_times[-1])
                server.submit(requests[sent])
                sent += 1
        arrival = server.next_arrival()
        if not (server.prefilling or server.running or server.waiting) and arrival is not None:
            time.sleep(max(0.0, min(arrival - server.now(), 0.05)))   # idle until then
        if progress and time.perf_counter() - last_progress > 10:
            last_progress = time.perf_counter()
            print(f"  serving: {done}/{len(requests)} requests done, {len(server.running)} running, "
                  f"{len(server.waiting)} waiting, {server.now():.0f} s", file=sys.stderr, flush=True)
