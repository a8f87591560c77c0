"""No leak and no corruption (issue 59), below the model: 1,000 requests with random shared prefixes,
cancellations and evictions through the server's prefix-sharing protocol over a page-table cache.

The server's own `PrefixSharing` (its `PrefixIndex` over `PoolPages`) is driven in the order
`Server.step` calls it: admission asks `admissible` (which evicts under host pressure), the prefill
starts with `take` and opens each stream on the taken pages (`LanePrefill`), chunks are appended,
the join `insert`s the prompt's whole pages (a request of one token leaves at its join instead),
each decode step appends a row, and the leave or a cancellation closes the streams. The model is
left out: a row is self-describing, [request, stream, unit, hash of the tokens up to the unit], as
a latent depends on its whole prefix. Checked every iteration: each page's count is its holders
(open streams plus the index), a page's bytes stay as they were when it was first shared until its
count is back to 0 (checksummed), and a taken prefix's rows are this prompt's. Afterwards every count
is the index's alone, and zero once the index is cleared. Seeded; about 2 s on a 2-core CPU."""
import random
from types import SimpleNamespace

import numpy as np
import torch

from hisparse.cache import HierarchicalKVCache
from hisparse.runtime import page_rows_of, token_slices
from hisparse.serving.sharing import PAGE_TOKENS as P
from hisparse.serving.sharing import PrefixSharing

REQUESTS, LANES, LAYERS = 1000, 4, 2       # LAYERS: streams a request (DSA: one a layer)
MAX_CONTEXT, CHUNK, VOCAB = 8 * P, 2 * P, 7
HOST_PAGES = 40                            # < LANES * LAYERS * 8 pages: admissions wait and evict
ROW = 4                                    # request, stream, unit, prefix hash (int32)
HASH = 2 ** 31 - 1


def prefix_hashes(tokens: list[int]) -> list[int]:
    """Hash of tokens[:u + 1] for each unit u (what a row's value depends on)."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % HASH
        out.append(h)
    return out


def rows_of(rid: int, stream: int, hashes: list[int], start: int, end: int) -> torch.Tensor:
    """The rows of units start .. end - 1 that request `rid` writes to its `stream`-th stream: [n, ROW]."""
    units = torch.arange(start, end, dtype=torch.int32)
    return torch.stack([torch.full_like(units, rid), torch.full_like(units, stream), units,
                        torch.tensor(hashes[start:end], dtype=torch.int32)], 1)


def workload(rng: random.Random) -> list[SimpleNamespace]:
    """Prompts on 12 shared prefixes (some extending an earlier one part way: the index splits nodes),
    cut at random and given a tail; a fifth extend an earlier request's prompt and answer (a next turn)."""
    bases: list[list[int]] = []
    for _ in range(12):
        head = []
        if bases and rng.random() < 0.5:
            parent = rng.choice(bases)
            head = parent[:rng.randrange(len(parent) + 1)]
        bases.append(head + [rng.randrange(VOCAB) for _ in range(rng.randrange(P, 5 * P) - len(head) + 1)])
    reqs = []
    for rid in range(REQUESTS):
        answer = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]      # its tokens, fixed ahead
        if reqs and rng.random() < 0.2:
            prev = rng.choice(reqs)
            prompt = prev.prompt + prev.answer + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, P))]
        else:
            base = rng.choice(bases)
            prompt = base[:rng.randrange(len(base) // 2, len(base) + 1)] + \
                [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 2 * P))]
        prompt = prompt[:MAX_CONTEXT - len(answer)]
        hashes = prefix_hashes(prompt + answer)
        reqs.append(SimpleNamespace(rid=rid, prompt=prompt, answer=answer, hashes=hashes, streams=[], done=0,
                                    generated=0))
    return reqs


class RowsRuntime:
    """The family runtime's prefix-sharing side for these rows: one part a layer (a stream's rows
    [T, ROW], DSA's latents without indexer keys), all of it on the stream's host pages."""
    row_token_dims = (0,)

    def __init__(self, cache: HierarchicalKVCache):
        self.cache = cache

    def prefilled_rows(self, states: list):
        """A joined request's rows, read back from its streams' pages (a state here: its streams)."""
        streams = states[0].streams
        return lambda b, i: (self.cache.host.rows[page_rows_of(self.cache, self.cache.stream_pages(streams[i]))],)

    def prefix_rows(self, rows: tuple, start: int, end: int, first: int = 0) -> tuple:
        return token_slices(rows, self.row_token_dims, start - first, end - first)

    def shared_page_parts(self, layer: int) -> tuple:
        return (0,)

    def shared_rows(self, cache: HierarchicalKVCache, pages: list[list[int]]) -> dict[int, tuple]:
        return {layer: (cache.host.rows[page_rows_of(cache, stream_pages)],) for layer, stream_pages in enumerate(pages)}


class Churn:
    """The server's loop over a page-table cache, a request at a time in prefill (see the docstring)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.cache = HierarchicalKVCache(LANES * LAYERS, 4, HOST_PAGES * P, ROW, dtype=torch.int32, device="cpu",
                                         pin=False, page_rows=P, map_rows=LANES * LAYERS * MAX_CONTEXT)
        self.pool = self.cache.host
        memory = SimpleNamespace(cache=self.cache, streams_per_request=LAYERS, runtime=RowsRuntime(self.cache),
                                 page_rows=P)
        self.sharing = PrefixSharing(memory)
        self.queue = workload(self.rng)
        self.prefilling, self.running = None, {}            # the request in prefill; lane -> request
        self.frozen: dict[int, int] = {}                    # page -> checksum, from its first share to its count 0
        self.weights = torch.randint(1, 2 ** 20, (P * ROW,), generator=torch.Generator().manual_seed(seed))
        share, release = self.pool.pages.share, self.pool.pages.release

        def freezing_share(pages):                     # a page shared is frozen: its bytes recorded
            pages = list(pages)
            sums = self.checksums()
            for page in pages:
                self.frozen.setdefault(page, sums[page])
            share(pages)

        def checked_release(pages):                    # and checked before each holder lets go
            pages = list(pages)
            self.check_frozen(set(pages))
            freed = release(pages)
            for page in freed:
                self.frozen.pop(page, None)
            return freed
        self.pool.pages.share, self.pool.pages.release = freezing_share, checked_release
        self.counts = dict(finished=0, cancelled_queued=0, cancelled_prefill=0, cancelled_running=0,
                           evictions=0, taken=0, one_token=0)

    # -- the server's calls ------------------------------------------------------------------------

    def admit(self) -> None:
        """`scheduler.admit(_admissible)`, then `runner.start_prefill` (take, open on its pages, adopt)."""
        lane = next((i for i in range(LANES) if i not in self.running), None)
        if self.prefilling is not None or not self.queue or lane is None:
            return
        r = self.queue[0]
        prompt = torch.tensor(r.prompt)
        cached = self.sharing.index.cached_pages
        admitted = self.sharing.admissible([len(r.prompt) + len(r.answer)] * LAYERS, prompt)
        self.counts["evictions"] += self.sharing.index.cached_pages < cached
        if not admitted:
            return
        self.queue.pop(0)
        shared = self.sharing.take(prompt)
        for i in range(LAYERS):                                             # LanePrefill's streams
            r.streams.append(self.cache.open_stream(len(r.prompt) + len(r.answer), shared[0][i] if shared else ()))
        if shared is not None:                                              # adopt: the prefix's rows held already
            handoff = shared[1]
            for i, stream in enumerate(r.streams):
                assert self.cache.stream_len[stream] == handoff.prompt_len
                latents = handoff.rows[i][0]
                want = rows_of(0, i, r.hashes, 0, handoff.prompt_len)
                assert torch.equal(latents[:, 1:], want[:, 1:]), f"request {r.rid} took a prefix of other rows"
            r.done = handoff.prompt_len
            self.counts["taken"] += 1
        r.lane = lane
        self.prefilling = r

    def piece(self) -> None:
        """One chunk through every layer (`chunk_done`: its rows appended), and the join when it ends it."""
        r = self.prefilling
        if r is None:
            return
        end = min(r.done + CHUNK, len(r.prompt))
        for i, stream in enumerate(r.streams):
            self.cache.append(stream, rows_of(r.rid, i, r.hashes, r.done, end))
        r.done = end
        if r.done < len(r.prompt):
            return
        self.prefilling = None                          # `_join_prefill`: its first token out
        r.generated = 1
        if r.generated == len(r.answer):                # its only token: the prefill's streams go back
            self.close(r)
            self.counts["one_token"] += 1
            self.counts["finished"] += 1
            return
        self.running[r.lane] = r
        state = SimpleNamespace(layers=[None] * LAYERS, streams=r.streams)   # what RowsRuntime reads
        self.sharing.insert(torch.tensor(r.prompt), state, r.streams)

    def decode(self) -> None:
        """One step: each running request's newest row (its last token's) written, then the finished leave."""
        for lane, r in list(self.running.items()):
            unit = len(r.prompt) + r.generated - 1
            for i, stream in enumerate(r.streams):
                self.cache.append(stream, rows_of(r.rid, i, r.hashes, unit, unit + 1))
            r.generated += 1
            if r.generated == len(r.answer):
                self.close(self.running.pop(lane))
                self.counts["finished"] += 1

    def cancel(self) -> None:
        """A client gone: a queued request leaves the queue, a prefilling one its streams (no insert), a
        running one its lane."""
        where = self.rng.choice(["queued", "prefill", "running"])
        if where == "queued" and self.queue:
            self.queue.pop(self.rng.randrange(len(self.queue)))
        elif where == "prefill" and self.prefilling is not None:
            self.close(self.prefilling)
            self.prefilling = None
        elif where == "running" and self.running:
            self.close(self.running.pop(self.rng.choice(sorted(self.running))))
        else:
            return
        self.counts[f"cancelled_{where}"] += 1

    def close(self, r) -> None:
        for stream in r.streams:
            self.cache.close_stream(stream)
        r.streams = []

    # -- checks --------------------------------------------------------------------------------------

    def holders(self) -> np.ndarray:
        """Each page's holders: the open streams' pages and the index's."""
        want = np.zeros(HOST_PAGES, dtype=np.int64)
        live = ([self.prefilling] if self.prefilling else []) + list(self.running.values())
        for r in live:
            for stream in r.streams:
                np.add.at(want, self.cache.stream_pages(stream), 1)
        for node in self.sharing.index._nodes():
            np.add.at(want, [p for stream in node.pages for p in stream], 1)
        return want

    def checksums(self) -> list[int]:
        return (self.pool.rows.view(HOST_PAGES, P * ROW).long() * self.weights).sum(1).tolist()

    def check_frozen(self, pages: set[int]) -> None:
        """The pages frozen (shared once, not free since) among `pages` hold the bytes they held then."""
        sums = self.checksums()
        for page in pages & self.frozen.keys():
            assert self.frozen[page] == sums[page], f"shared page {page} changed"

    def check(self) -> None:
        """Every count is its holders, every shared page frozen, and no frozen page changed."""
        count = self.pool.pages.count
        want = self.holders()
        assert np.array_equal(count, want), f"counts differ from holders at pages {np.flatnonzero(count != want)}"
        assert set(np.flatnonzero(count > 1).tolist()) <= self.frozen.keys()
        self.check_frozen(set(range(HOST_PAGES)))

    def run(self) -> None:
        steps = 0
        while self.queue or self.prefilling or self.running:
            self.admit()
            self.piece()
            self.decode()
            if self.rng.random() < 0.08:
                self.cancel()
            self.check()
            steps += 1
            assert steps < 50 * REQUESTS, "no progress"


def test_a_thousand_requests_with_shared_prefixes_cancellations_and_evictions_leak_nothing():
    churn = Churn(seed=59)
    churn.run()
    c, index = churn.counts, churn.sharing.index
    assert c["finished"] + c["cancelled_queued"] + c["cancelled_prefill"] + c["cancelled_running"] == REQUESTS
    assert min(c["cancelled_queued"], c["cancelled_prefill"], c["cancelled_running"], c["one_token"]) > 0, c
    assert c["evictions"] > 50 and c["taken"] > REQUESTS // 3, c
    assert churn.cache.free_streams() == churn.cache.max_streams
    count = churn.pool.pages.count
    assert int(count.sum()) == index.cached_pages == int((count > 0).sum()), "pages held besides the index's"
    assert index.clear() > 0
    assert int(count.sum()) == 0 and churn.pool.free_rows == churn.pool.capacity
    assert churn.pool.pages.free_runs.runs == [(0, HOST_PAGES)]
