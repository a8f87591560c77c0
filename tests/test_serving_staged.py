"""Serving's lane prefill for Quest and NSA (`QuestRuntime.lane_prefill`, `NsaRuntime.lane_prefill`):
a request prefilled in place, chunk by chunk, ends in its lane bitwise as the generic path leaves it
(the whole prompt in the model's own state, then gathered into the lane at the end), with the same
host rows and stream lengths, and decodes the same logits; the host pool holds the first chunk's
units before the prompt is done (tiny models, eager prefill, interpreter)."""
import dataclasses
import functools

import pytest
import torch

from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_
from hisparse.serving import Request, Server
from hisparse.serving.runner import PrefillJob
from tests.test_serving import DEVICE, MAX_CONTEXT, QUICK, SETTINGS, tiny

# (prompt length, prefill chunk) per family: prompts that end inside a unit (16-token pages, 64-token
# blocks), chunks that end inside units, so units the previous chunk left partial are rewritten
CASES = {"llama": (45, 10), "nsa": (70, 40)}
UNIT = {"llama": 16, "nsa": 64}
MODES = ("resident", "hisparse")
NOT_COMPARED = {"cache", "lanes", "anchor_streams", "prefetched", "host_streams", "weight_k", "weight_v"}


class GatheredPrefill:
    """The reference a lane prefill is held against (`LanePrefill`'s contract): the whole prompt in
    the model's own state (`model.new_state(1, len)`), then at the join gathered by `gather_layers`
    and copied into the lane field by field."""

    runs, workspace_bytes = None, 0

    def __init__(self, server: Server, request: Request):
        self.server, self.request = server, request
        self.state = server.model.new_state(1, len(request.prompt))

    def chunk_done(self, start: int, end: int) -> None:
        pass

    def cancel(self) -> None:
        pass

    def join(self) -> None:
        server, request = self.server, self.request
        length = len(request.prompt)
        rows = server.runtime.prefilled_rows([self.state])
        single = server.runtime.gather_layers(server.memory.kv_mode, server.cache, rows,
                                              torch.tensor([length], device=server.device), server.max_context,
                                              server.prefetch, host_tokens=length + request.max_new_tokens)
        for kv, one in zip(server.layers, single):
            for f in dataclasses.fields(kv):
                mine, theirs = getattr(kv, f.name), getattr(one, f.name)
                if f.name not in NOT_COPIED and isinstance(mine, torch.Tensor):
                    mine.view(server.lanes, -1)[request.lane].copy_(theirs.reshape(-1))
            if hasattr(kv, "host_streams") and kv.streams is not None:
                kv.host_streams[request.lane] = one.host_streams[0]


NOT_COPIED = {"cache", "anchor_layer", "anchor_streams", "prefetched", "newest", "host_streams", "lanes",
              "weight_k", "weight_v"}


class GenericServer(Server):
    """The Server with each request prefilled as `GatheredPrefill` does. A subclass rather than a
    patched runtime, so nothing is shared with the server under test; the lanes are given, so the
    workspace accounting (which differs) sizes nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.runner.start_prefill = lambda request, placement: PrefillJob(request, GatheredPrefill(self, request))


@functools.cache
def tiny_shared_quest():
    """Llama tiny with 2 dense layers and 2 Quest layers sharing one selection (the second in
    lockstep with the first: `quest_selection_group` 2)."""
    config = config_from_dict(dict(TINY_CONFIGS["llama"], num_hidden_layers=4, quest_selection_group=2))
    model = build_model(config).to(DEVICE).float()
    randomize_(model, 5)
    return model


def servers(family: str, mode: str, chunk: int, model=None):
    model = model or tiny(family)
    kw = dict(SETTINGS[family], max_context=MAX_CONTEXT, lanes=2, prefill_chunk=chunk, keep_logits=True, **QUICK)
    if mode == "resident":
        kw.pop("cache_slots")
    pair = Server(model, mode, **kw), GenericServer(model, mode, **kw)
    for server in pair:     # no warm-up: its decode steps (compiles, a graph capture) prepare nothing in the
        server.runner.warmed = True    # interpreter, and NSA's cost seconds each here
    return pair


def two_requests(family: str) -> list[Request]:
    """A short request decoding while a long one prefills chunk by chunk into the other lane (the
    decode steps between its chunks write every lane, the prefilling one too): the short one is
    admitted and decodes once in the first iteration, then once beside each chunk; both finish in
    the iteration the long one joins and decodes once (few decode steps: NSA's are slow here)."""
    length, chunk = CASES[family]
    gen = torch.Generator().manual_seed(len(family))
    short = Request(torch.randint(0, 97, (7,), generator=gen), 2 + -(-length // chunk), arrival=0.0)
    return [short, Request(torch.randint(0, 97, (length,), generator=gen), 2, arrival=0.0)]


def serve_with_snapshot_at_join(server: Server, reqs: list[Request]) -> dict:
    """Serve the requests step by step; returns `lane_snapshot` taken as the last one joins its lane
    (before that iteration's decode step)."""
    taken = {}
    join = server._join_prefill

    def joined(job, step, finished):
        join(job, step, finished)
        if job.request is reqs[-1]:
            taken.update(lane_snapshot(server))

    server._join_prefill = joined
    server.open()
    for r in reqs:
        server.submit(r)
    while server.busy:
        server.step()
    server.close()
    assert taken, "the last request never joined"
    return taken


def lane_snapshot(server: Server) -> dict:
    """Every layer's per-lane tensors and stream ids, the hot cache, and every open stream's length
    and host rows (copies: the two servers share one model, so they run one after the other)."""
    out = {}
    for i, kv in enumerate(server.layers):
        out[f"layer {i}: type"] = type(kv).__name__
        for f in dataclasses.fields(kv):
            value = getattr(kv, f.name)
            if f.name not in NOT_COMPARED and isinstance(value, torch.Tensor):
                out[f"layer {i}: {f.name}"] = value.clone()
        if hasattr(kv, "host_streams"):
            out[f"layer {i}: host_streams"] = [list(ids) for ids in kv.host_streams]
    if server.cache is not None:
        cache = server.cache
        out["slots"] = cache.slots.clone()
        for s in sorted(cache._open):
            base, n = int(cache.state.host_base[s]), cache.stream_len[s]
            out[f"stream {s}"] = base, n, cache.host.rows[base:base + n].clone()
    return out


def assert_same(a, b, what: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{what} differs"
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{what} differs"
        for x, y in zip(a, b):
            assert_same(x, y, what)
    else:
        assert a == b, f"{what} differs: {a} != {b}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(CASES))
def test_lane_prefill_joins_bitwise_as_the_generic_path(family, mode):
    """(a) As the long request joins, every lane's tensors, the stream ids, the hot cache and every
    open stream's length and host rows equal the generic path's, the short request decoding beside
    it all along; then every token and logit of both requests are equal. (Both requests are still
    running at the join: the lane prefill opens its streams when the request is admitted, the
    generic path at the join, so a request leaving in between may hand them other ids and regions,
    with the same contents.)"""
    _, chunk = CASES[family]
    staged, generic = servers(family, mode, chunk)
    reqs, again = two_requests(family), two_requests(family)
    joined = serve_with_snapshot_at_join(staged, reqs)
    expected = serve_with_snapshot_at_join(generic, again)
    steps = staged.schedule.iterations
    assert steps == generic.schedule.iterations
    assert sum(s.prefilled > 0 and s.decoded for s in steps) >= 2, "no decode step ran beside a chunk"
    assert joined.keys() == expected.keys()
    for name in joined:
        assert_same(joined[name], expected[name], name)
    for a, b in zip(reqs, again):
        assert a.tokens == b.tokens and len(a.tokens) == a.max_new_tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), f"request {a.rid}: logits differ"


def test_shared_quest_layers_join_in_lockstep():
    """(a) with a Quest layer sharing its anchor's selection (hisparse): the same lanes, streams and
    host rows as the generic path, the shared layer's anchor streams still the anchor's tensor, which
    holds the request's streams."""
    _, chunk = CASES["llama"]
    staged, generic = servers("llama", "hisparse", chunk, tiny_shared_quest())
    anchor, shared = staged.layers[2], staged.layers[3]
    assert shared.anchor_layer == 2 and shared.anchor_streams is anchor.streams
    reqs, again = two_requests("llama"), two_requests("llama")
    joined = serve_with_snapshot_at_join(staged, reqs)
    expected = serve_with_snapshot_at_join(generic, again)
    assert joined.keys() == expected.keys()
    for name in joined:
        assert_same(joined[name], expected[name], name)
    streams = joined["layer 2: host_streams"][1]          # the long request's lane (the short one took 0)
    assert len(streams) == 2 and joined["layer 2: streams"][1].tolist() == streams
    assert joined["layer 3: streams"][1].tolist() == joined["layer 3: host_streams"][1] != streams
    assert shared.anchor_streams is anchor.streams
    for a, b in zip(reqs, again):
        assert a.tokens == b.tokens
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), f"request {a.rid}: logits differ"


@pytest.mark.parametrize("family", list(CASES))
def test_host_pool_holds_the_first_chunk_before_the_prompt_is_done(family):
    """(b) After one step of a long prompt in small chunks the request's streams hold the units of
    its first chunk (the last one partial), with the rows the finished prefill leaves there; the
    prefill holds its workspace of the prompt's length only, as `lane_workspace_bytes` says."""
    unit = UNIT[family]
    chunk = unit + unit // 2                               # one whole unit and half of the next
    prompt = MAX_CONTEXT - 3
    server, _ = servers(family, "hisparse", chunk)
    server.open()
    request = server.submit(Request(torch.randint(0, 97, (prompt,), generator=torch.Generator().manual_seed(1)), 3,
                                    arrival=float("nan")))
    server.step()
    job = server._prefilling
    assert job is not None and job.done == chunk < prompt
    assert job.lane_prefill.workspace_bytes == server.runtime.lane_workspace_bytes("hisparse", prompt)
    assert server.workspace_bytes == server.runtime.lane_workspace_bytes("hisparse", MAX_CONTEXT)
    streams = [s for ids in job.lane_prefill.streams.values() for s in ids]
    assert streams and all(server.cache.stream_len[s] == 2 for s in streams)
    first = {s: server.cache.host.rows[int(server.cache.state.host_base[s])].clone() for s in streams}
    assert all(bool(row.any()) for row in first.values())
    while server.lane_request[0] is not request:
        server.step()
    for s in streams:
        assert torch.equal(server.cache.host.rows[int(server.cache.state.host_base[s])], first[s])
    assert server.cache.stream_len[streams[0]] == -(-(prompt + 1) // unit)     # the prompt and one token
    while server.busy:
        server.step()
    server.close()
