"""Prefill overlapping decode (DSA): an empty lane's decode write lands where no request reads (its
last position; hybrid's resident write on the cache's trash row), so a prefill into that lane may run
beside the step; with `prefill_overlap` the prefill runs a few layers an iteration between decode
steps, and every token and logit stays bitwise the resident replay's (tiny models, interpreter)."""
import torch
from test_serving import MAX_CONTEXT, QUICK, SETTINGS, tiny
from test_serving_hybrid import hybrid_server

from hisparse.serving import Request, Server

PATTERN = 7777.0            # no value a tiny model's step computes


def _serve_one_in_lane_0(server: Server, steps: int, fill) -> None:
    """One request decoding in lane 0, the others empty: `fill()` once it decodes, then `steps` steps."""
    server.open()
    request = server.submit(Request(torch.arange(9) % 97, steps + 2, arrival=float("nan")))
    server.step()                                    # prefilled (one chunk), joined, first decode step
    assert request.lane == 0 and len(request.tokens) == 2
    fill()
    for _ in range(steps):
        server.step()
    while server.busy:
        server.step()
    server.close()


def test_an_empty_lanes_decode_write_lands_on_its_last_position_only():
    """Lanes 1 and 2 empty beside a decoding request: their indexer keys (and resident latents) below
    position capacity - 1 keep the values put there, bit for bit, and position capacity - 1 is what
    the step wrote (a read-modify-write at position 0, the old way, would leave it as filled)."""
    model = tiny("deepseek_v32")
    for mode in ("resident", "hisparse"):
        server = Server(model, mode, lanes=3, max_context=MAX_CONTEXT, **SETTINGS["deepseek_v32"], **QUICK)
        pools = [t for kv in server.layers for t in (kv.index_keys, kv.latent) if t is not None]
        assert len(pools) == (4 if mode == "resident" else 2)         # 2 layers: keys (and latents)

        def fill():
            for pool in pools:
                pool[1:].fill_(PATTERN)
        _serve_one_in_lane_0(server, 3, fill)
        for pool in pools:
            assert pool.shape[1] == MAX_CONTEXT
            assert torch.equal(pool[1:, :-1], torch.full_like(pool[1:, :-1], PATTERN)), mode
            assert (pool[1:, -1] != PATTERN).all(), f"{mode}: an empty lane's step wrote nothing at capacity - 1"


def test_hybrid_writes_of_lanes_not_resident_go_to_the_trash_row():
    """Hybrid, one request resident in lane 0 and two empty lanes: between steps the only rows of
    `cache.gpu_rows` that change are the resident lane's newest token's, one a layer, and the trash
    row past every stream's (a write to row 0, the old way, could land in a run being prefilled)."""
    server = hybrid_server(tiny("deepseek_v32"), extra_runs=1, cache_slots=48, prefill_chunk=24, **QUICK)
    cache = server.cache
    assert cache.trash_row == cache.max_streams * (cache.cache_slots + 1) == cache.gpu_rows.shape[0] - 1
    changed = []
    decode = server._decode_step

    def watched(*warm_up):
        if warm_up:
            return decode(*warm_up)
        request = server.lane_request[0]
        cache.gpu_rows[cache.trash_row] = PATTERN      # the empty lanes write the same values every step
        before = cache.gpu_rows.clone()
        logits = decode()
        rows = (cache.gpu_rows != before).any(-1).nonzero()[:, 0].tolist()
        want = sorted(int(kv.row_base[0]) + request.length for kv in server.layers) + [cache.trash_row]
        changed.append((rows, want))
        return logits

    server._decode_step = watched

    def fill():
        assert server.layers[0].resident[0] and not server.layers[0].resident[1:].any()
        cache.gpu_rows.fill_(PATTERN)
    _serve_one_in_lane_0(server, 3, fill)
    assert len(changed) >= 3
    for rows, want in changed[1:]:                 # (the first step's rows were not filled yet)
        assert rows == want


def _drain(pieces) -> tuple[int, torch.Tensor]:
    """Run a prefill_pieces generator to its end: (pieces run, its logits)."""
    count = 0
    while True:
        count += 1
        try:
            next(pieces)
        except StopIteration as done:
            return count, done.value


def test_prefill_pieces_are_bitwise_the_prefill():
    """glm_moe_dsa (3 layers, one sharing its anchor's selection), two chunks: one layer a piece (3
    pieces a chunk) or two (2 pieces) leaves the logits and the state bitwise as `prefill` does."""
    model = tiny("glm_moe_dsa")
    prompt = torch.randint(0, 97, (1, 29), generator=torch.Generator().manual_seed(1))
    whole = model.new_state(1, 40)
    want = [model.prefill(part, whole, last_logits=True) for part in prompt.split(17, dim=1)]
    layers = model.config.num_hidden_layers
    for per in (1, 2, layers):
        state = model.new_state(1, 40)
        for part, logits in zip(prompt.split(17, dim=1), want):
            count, got = _drain(model.prefill_pieces(part, state, per, last_logits=True))
            assert count == -(-layers // per) and torch.equal(got, logits), per
        assert torch.equal(state.lengths, whole.lengths) and state.max_length == whole.max_length == 29
        for a, b in zip(state.layers, whole.layers):
            assert torch.equal(a.latent, b.latent)
            assert (a.index_keys is None) == (b.index_keys is None)
            assert a.index_keys is None or torch.equal(a.index_keys, b.index_keys)
