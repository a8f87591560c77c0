"""The kernels' prefill (`model.prefill(..., fast=True)`, the Engine's default) against the eager
torch reference: hidden states and logits within float32's tolerance, DSA's per-query selections
equal the reference's (ties to the lower token id), and resident == hisparse bitwise after it."""
import pytest
import torch

from benchmarks.bench_prefill import QUICK, prefill_flops
from hisparse.dsa.ops import dsa_prefill_select
from hisparse.dsa.reference import stable_topk
from hisparse.engine import Engine
from hisparse.models.config import config_from_dict
from hisparse.models.loading import build_model
from hisparse.models.tiny import TINY_CONFIGS, randomize_

FAMILIES = ("deepseek_v32", "glm_moe_dsa", "llama", "qwen3")
TOLERANCE = 1e-4          # float32, relative to the logits' scale


def tiny(family: str, seed: int = 0):
    model = build_model(config_from_dict(dict(TINY_CONFIGS[family])))
    randomize_(model, seed=seed)
    return model.eval()


MODELS = {family: tiny(family) for family in FAMILIES}


def both(model, ids: torch.Tensor, chunk: int | None):
    """(reference logits, its state), (fast logits, its state) of one prompt batch."""
    out = []
    for fast in (False, True):
        state = model.new_state(ids.shape[0], ids.shape[1] + 2)
        out.append((model.prefill(ids, state, chunk, fast=fast), state))
    return out


# (length, chunk): one chunk, chunks ending inside Quest's pages with a partial last one ((37, 8) and (29, 5)),
# a prompt under DSA's k, many small chunks. DSA's prefill takes seconds a case in the interpreter, so each DSA
# family runs one of the two partial-last-chunk cases (the same path through its kernels); Quest's run all
SHAPES = [(37, None), (37, 8), (29, 5), (3, None), (11, 4)]
ONE_OF_TWO = {("deepseek_v32", 29, 5), ("glm_moe_dsa", 37, 8)}


@pytest.mark.parametrize("family,length,chunk", [
    pytest.param(family, length, chunk, id=f"{length}-{chunk}-{family}")
    for family in FAMILIES for length, chunk in SHAPES if (family, length, chunk) not in ONE_OF_TWO])
def test_fast_prefill_agrees_with_the_reference(family, length, chunk):
    """Odd lengths, chunk boundaries inside Quest's 16-token pages, prompts shorter than DSA's k = 8:
    the same logits and the same written KV, within float32's tolerance."""
    model = MODELS[family]
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
    (ref, ref_state), (fast, fast_state) = both(model, ids, chunk)
    assert ref.shape == fast.shape == (2, length, model.config.vocab_size)
    scale = ref.abs().max()
    assert (fast - ref).abs().max() <= TOLERANCE * scale, (fast - ref).abs().max()
    for a, b in zip(ref_state.layers, fast_state.layers):
        for name, x in vars(a).items():
            y = getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert torch.allclose(x, y, atol=1e-4, rtol=1e-4), name
    assert torch.equal(ref_state.lengths, fast_state.lengths)


def test_last_logits_are_the_last_row_of_the_full_logits():
    model = MODELS["deepseek_v32"]
    ids = torch.randint(0, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    full = model.prefill(ids, model.new_state(1, 21), 8, fast=True)
    last = model.prefill(ids, model.new_state(1, 21), 8, fast=True, last_logits=True)
    assert last.shape == (1, 1, model.config.vocab_size)
    assert torch.allclose(last[:, 0], full[:, -1], atol=1e-5, rtol=1e-5)     # one row through lm_head, not 21


def reference_selection(q, weights, keys, start, k):
    """The reference model's per-query top-k (Indexer.prefill_topk's arithmetic), -1 past each length."""
    scores = torch.relu(torch.einsum("shd,td->sht", q.float(), keys.float())) * 1.0
    index = torch.einsum("sh,sht->st", weights, scores)
    t = keys.shape[0]
    causal = torch.arange(start, t, device=keys.device)[:, None] >= torch.arange(t, device=keys.device)[None, :]
    chosen = stable_topk(index.masked_fill(~causal, float("-inf")), min(k, t))
    chosen = torch.where(causal.gather(1, chosen), chosen, -1)
    return torch.nn.functional.pad(chosen, (0, k - chosen.shape[1]), value=-1).to(torch.int32)


@pytest.mark.parametrize("start,s,k", [(0, 13, 8), (9, 7, 8), (20, 5, 32)])
def test_prefill_selection_is_the_references_with_ties_to_the_lower_id(start, s, k):
    """Random scores: the reference's selection exactly. Tied scores (keys with no positive dot, so
    every score is 0): the lowest ids, in order, as the reference's stable sort picks them. A
    query with fewer than k tokens pads with -1; the row blocks of `max_elements` change nothing."""
    gen = torch.Generator().manual_seed(start + s)
    heads, d, t = 4, 16, start + s
    q, weights = torch.randn(s, heads, d, generator=gen), torch.rand(s, heads, generator=gen)
    keys = torch.randn(t, d, generator=gen)
    got = dsa_prefill_select(q, weights, keys, start, k)
    assert torch.equal(got, reference_selection(q, weights, keys, start, k))
    assert torch.equal(dsa_prefill_select(q, weights, keys, start, k, max_elements=t), got)   # one row a block
    tied = dsa_prefill_select(q.abs(), weights, -keys.abs(), start, k)
    assert torch.equal(tied, reference_selection(q.abs(), weights, -keys.abs(), start, k))
    for i in range(s):
        n = min(k, start + i + 1)
        assert tied[i, :n].tolist() == list(range(n)) and (tied[i, n:] == -1).all()


def test_prefill_selection_refuses_a_start_that_does_not_fit_the_keys():
    q, w, keys = torch.randn(4, 2, 16), torch.rand(4, 2), torch.randn(9, 16)
    with pytest.raises(ValueError, match="start=3: a chunk of 4 queries over 9 keys starts at 5"):
        dsa_prefill_select(q, w, keys, 3, 8)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "llama"])
def test_resident_and_hisparse_are_bitwise_equal_after_a_fast_prefill(family):
    """The Engine's default prefill (the kernels): hisparse decodes bitwise as resident does, and
    greedy tokens agree with a run after the reference prefill. Quest as llama: qwen3's prefill
    differs in its projections alone (its fast prefill against the reference is checked above), and
    what hisparse does after it is the same."""
    model = MODELS[family]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (35, 20)]
    quest = {"token_budget": 48} if family in ("llama", "qwen3") else {}
    slots = 4 if quest else 8
    runs = {}
    for mode, prefill in (("resident", "model"), ("hisparse", "model"), ("resident", "reference")):
        engine = Engine(model, mode, cache_slots=None if mode == "resident" else slots, chunk_size=16,
                        prefill=prefill, **quest)
        runs[mode, prefill] = engine.generate(prompts, new_tokens=5)
    fast, hier, ref = runs["resident", "model"], runs["hisparse", "model"], runs["resident", "reference"]
    assert torch.equal(fast.tokens, hier.tokens)
    assert all(torch.equal(a, b) for a, b in zip(fast.logits, hier.logits))
    assert torch.equal(fast.tokens, ref.tokens)
    assert (fast.logits[0] - ref.logits[0]).abs().max() <= TOLERANCE * ref.logits[0].abs().max()


def test_engine_names_its_prefills():
    with pytest.raises(ValueError, match=r"prefill must be one of \('model', 'reference', 'random'\), got 'fast'"):
        Engine(MODELS["llama"], "resident", prefill="fast")


def test_prefill_flops_count_each_querys_attention():
    """DSA: under k tokens a query attends all of them, past k exactly k; Quest: its causal prefix."""
    dsa = config_from_dict(dict(QUICK["dsa"]))
    k = dsa.index_topk
    step = prefill_flops("dsa", dsa, k + 2) - prefill_flops("dsa", dsa, k + 1)
    step_before = prefill_flops("dsa", dsa, k + 1) - prefill_flops("dsa", dsa, k)
    indexer = 2 * dsa.num_hidden_layers * dsa.index_n_heads * dsa.index_head_dim
    assert step - step_before == pytest.approx(indexer)        # past k only the indexer still grows
    quest = config_from_dict(dict(QUICK["quest"]))
    grow = [prefill_flops("quest", quest, n + 1) - prefill_flops("quest", quest, n) for n in (10, 11)]
    assert grow[1] - grow[0] == pytest.approx(2 * quest.num_hidden_layers * 2 * quest.num_attention_heads
                                              * quest.head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("family,context", [("dsa", 5000), ("quest", 3000)])
def test_fast_prefill_at_real_shapes_agrees_with_the_reference_in_bf16(family, context):
    """On the GPU in bf16 at the study models' attention shapes (DSA: 128 heads, 512 + 64 latents,
    k = 2048, the Gluon decode kernel on Hopper; Quest: 32 / 8 heads of 128), two layers, a prompt
    longer than k in chunks of 2048: the last logits within bf16's tolerance of the reference's, and
    nearly every selected token the same (accumulation order differs, so near-ties may swap)."""
    from benchmarks.bench_prefill import DSA, QUEST
    raw = dict(DSA, num_hidden_layers=2, first_k_dense_replace=2) if family == "dsa" else \
        dict(QUEST, num_hidden_layers=2, hidden_size=1024, intermediate_size=2048, quest_dense_layers=0)
    with torch.device("cuda"):
        model = build_model(config_from_dict(raw))
    randomize_(model, seed=0, on_device=True)
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    (ref, ref_state), (fast, fast_state) = both(model, ids, 2048)
    error = (fast[0, -1].float() - ref[0, -1].float()).abs().max() / ref[0, -1].float().abs().max()
    assert error < 3e-2, error
    if family == "dsa":
        layer = model.model.layers[0].self_attn
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        cos, sin = model.rotary(torch.arange(context, device="cuda")[None], x.dtype)
        q, k, w = layer.indexer.project(x, layer.q_a_layernorm(layer.q_a_proj(x)), cos, sin)
        tail, weights = context - 256, w[0, -256:] * layer.indexer.softmax_scale     # the last 256 queries
        got = dsa_prefill_select(q[0, -256:], weights, k[0], tail, layer.indexer.topk)
        want = reference_selection(q[0, -256:], weights, k[0], tail, layer.indexer.topk)
        same = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(got.cpu(), want.cpu()))
        assert same >= 0.99 * int((want >= 0).sum()), same


@pytest.mark.parametrize("method", ["torch", "radix"])
@pytest.mark.parametrize("kind", ["continuous", "ties", "short"])
def test_eager_topk_is_topk_select(kind, method):
    """topk_of_indexer_scores (torch: float topk, sorts, exact keys only where ties straddle the k-th
    place; radix: the radix kernel's picks, sorted) returns topk_select's selection exactly: distinct
    scores, heavy ties (-0.0 among them), and rows shorter than k."""
    from hisparse.dsa.ops import topk_of_indexer_scores, topk_select
    gen = torch.Generator().manual_seed(7)
    n, t, k = 12, 50, 16
    scores = torch.randn(n, t, generator=gen)
    if kind == "ties":              # -0.0 and +0.0 mixed: one score to topk_select
        scores = torch.randint(-2, 3, (n, t), generator=gen).float() * 0.5
        scores[(scores == 0) & (torch.rand(n, t, generator=gen) < 0.5)] = -0.0
    lengths = torch.randint(1, k if kind == "short" else t + 1, (n,), generator=gen)
    scores = scores.masked_fill(torch.arange(t)[None, :] >= lengths[:, None], float("-inf"))
    assert torch.equal(topk_of_indexer_scores(scores, lengths, k, method), topk_select(scores, lengths, k))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["torch", "radix"])
def test_eager_topk_is_topk_select_on_the_gpu(method):
    """As above on the GPU at the prefill's shape (torch.topk and sort differ there): random scores,
    and scores quantised to many ties, -0.0 and +0.0 mixed, some rows shorter than k."""
    from hisparse.dsa.ops import topk_of_indexer_scores, topk_select
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, t, k = 512, 8192, 2048
    lengths = torch.randint(1, t + 1, (n,), device="cuda", generator=gen)
    for quantum in (None, 0.25):
        scores = torch.randn(n, t, device="cuda", generator=gen)
        if quantum:
            scores = (scores / quantum).round() * quantum
            scores[(scores == 0) & (torch.rand(n, t, device="cuda", generator=gen) < 0.5)] = -0.0
        scores = scores.masked_fill(torch.arange(t, device="cuda")[None, :] >= lengths[:, None], float("-inf"))
        assert torch.equal(topk_of_indexer_scores(scores, lengths, k, method), topk_select(scores, lengths, k))


# -- NSA ------------------------------------------------------------------------------------------
# The tiny NSA model at the kernels' block sizes (compressed 32 / 16, selection 64, 16 selected
# blocks, window 512: prompts here are shorter than the window and select every block), and a
# small geometry where the choice is real: selection blocks of 16, compressed 16 / 8, 3 selected,
# a window of 24, layers sharing their anchor's selection in pairs.
NSA_SMALL = {"compress_block_size": 16, "compress_block_stride": 8, "selection_block_size": 16,
             "num_selected_blocks": 3, "sliding_window": 24, "num_hidden_layers": 3, "selection_group": 2}


def tiny_nsa(**overrides):
    model = build_model(config_from_dict(dict(TINY_CONFIGS["nsa"], **overrides)))
    randomize_(model, seed=0)
    return model.eval()


NSA_MODELS = {"kernel-sizes": tiny_nsa(), "small-blocks": tiny_nsa(**NSA_SMALL)}


def selections_of(model, ids, chunk, fast):
    """Logits, state and each layer's per-query blocks [B, Hkv, S, n] per chunk, layer-major."""
    seen = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, args, out: seen.append(args[1].shared["nsa_blocks"]))
             for layer in model.model.layers]
    try:
        state = model.new_state(ids.shape[0], ids.shape[1] + 2)
        logits = model.prefill(ids, state, chunk, fast=fast)
    finally:
        for hook in hooks:
            hook.remove()
    return logits, state, seen


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("geometry,length,chunk", [
    ("kernel-sizes", 37, None), ("kernel-sizes", 29, 5), ("kernel-sizes", 3, None), ("kernel-sizes", 70, 24),
    ("small-blocks", 61, 13), ("small-blocks", 9, None), ("small-blocks", 45, None)])
def test_nsa_fast_prefill_agrees_with_the_reference(geometry, length, chunk):
    """Odd lengths, chunks ending inside compressed and selection blocks, prompts shorter than one
    compressed block and than the window (and, small-blocks, longer): the same logits and written KV
    within float32's tolerance, and every layer's per-query selections exactly the reference's."""
    model = NSA_MODELS[geometry]
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
    ref, ref_state, ref_blocks = selections_of(model, ids, chunk, fast=False)
    fast, fast_state, fast_blocks = selections_of(model, ids, chunk, fast=True)
    assert (fast - ref).abs().max() <= TOLERANCE * ref.abs().max(), (fast - ref).abs().max()
    for a, b in zip(ref_state.layers, fast_state.layers):
        for name, x in vars(a).items():
            assert torch.allclose(x, getattr(b, name), atol=1e-4, rtol=1e-4), name
    assert len(ref_blocks) == len(fast_blocks)
    assert all(torch.equal(a, b) for a, b in zip(ref_blocks, fast_blocks))


@pytest.mark.usefixtures("one_thread")
def test_nsa_fast_selection_over_many_row_blocks_is_the_references(monkeypatch):
    """A 300-token prompt at the kernels' sizes with 3 selected blocks of 5 (a real choice), the
    compressed branch in row blocks of a few queries: every query's blocks as the reference's. (The
    selected branch runs through its torch reference here, to keep the interpreter out of it.)"""
    import hisparse.nsa.model as nsa_model
    from hisparse.nsa.reference import nsa_prefill_selected_ref
    monkeypatch.setattr(nsa_model, "PREFILL_ELEMENTS", 4096)
    monkeypatch.setattr(nsa_model, "nsa_prefill_selected",
                        lambda q, k, v, blocks, start, size: nsa_prefill_selected_ref(q, k, v, blocks, start, size))
    model = tiny_nsa(num_selected_blocks=3, sliding_window=64)
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(5))
    ref, _, ref_blocks = selections_of(model, ids, 112, fast=False)
    fast, _, fast_blocks = selections_of(model, ids, 112, fast=True)
    assert all(torch.equal(a, b) for a, b in zip(ref_blocks, fast_blocks))
    chosen = ref_blocks[-1][0, 0, -1]
    assert (chosen >= 0).all() and set(chosen.tolist()) != {0, 1, 2}      # past the forced blocks: a choice
    assert (fast - ref).abs().max() <= TOLERANCE * ref.abs().max()


def test_nsa_selection_scores_are_the_block_map_and_ties_go_to_the_lower_block():
    """selection_scores (linear memory) equals p @ block_score_map: to float rounding on random
    probabilities, bitwise on dyadic ones (exact sums); tied scores then rank as the reference's
    top_blocks ranks them, the lower block first."""
    from hisparse.nsa.reference import block_score_map, selection_scores, top_blocks
    for overrides in ({}, NSA_SMALL):
        cfg = config_from_dict(dict(TINY_CONFIGS["nsa"], **overrides))
        for n_cmp, n_blocks in ((0, 1), (3, 2), (29, 8), (30, 8)):
            p = torch.rand(2, 3, n_cmp, generator=torch.Generator().manual_seed(n_cmp))
            want = p @ block_score_map(n_cmp, n_blocks, cfg, "cpu")
            assert torch.allclose(selection_scores(p, n_blocks, cfg), want, atol=1e-6)
            dyadic = (p * 4).floor() / 8                                    # 0, 1/8, 1/4, 3/8: many ties
            exact = selection_scores(dyadic, n_blocks, cfg)
            assert torch.equal(exact, dyadic @ block_score_map(n_cmp, n_blocks, cfg, "cpu"))
            picks = top_blocks(exact, torch.tensor(n_blocks), 4)
            for row, scores in zip(picks.flatten(0, 1), exact.flatten(0, 1)):
                rest = [j for j in row.tolist()[1:] if 0 < j < n_blocks - 2]
                assert rest == sorted(rest, key=lambda j: (-scores[j].item(), j))


@pytest.mark.usefixtures("one_thread")
def test_nsa_resident_and_hisparse_are_bitwise_equal_after_a_fast_prefill():
    """The Engine's default prefill (the kernels) on NSA: hisparse decodes bitwise as resident does;
    greedy tokens agree with a run after the reference prefill."""
    model = tiny_nsa(num_hidden_layers=1, num_selected_blocks=4, sliding_window=64)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen) for n in (130, 20)]
    runs = {}
    for mode, prefill in (("resident", "model"), ("hisparse", "model"), ("resident", "reference")):
        engine = Engine(model, mode, cache_slots=None if mode == "resident" else 4, chunk_size=48, prefill=prefill)
        runs[mode, prefill] = engine.generate(prompts, new_tokens=3)
    fast, hier, ref = runs["resident", "model"], runs["hisparse", "model"], runs["resident", "reference"]
    assert torch.equal(fast.tokens, hier.tokens)
    assert all(torch.equal(a, b) for a, b in zip(fast.logits, hier.logits))
    assert torch.equal(fast.tokens, ref.tokens)
    assert (fast.logits[0] - ref.logits[0]).abs().max() <= TOLERANCE * ref.logits[0].abs().max()


def test_nsa_prefill_flops_count_each_branchs_keys():
    """A query of length L attends its complete compressed blocks, the tokens of its selected blocks
    (every token while it has at most n blocks) and its window: counted one query at a time."""
    from benchmarks.bench_prefill import nsa_keys_attended
    cfg = config_from_dict(dict(QUICK["nsa"]))
    def keys(length):
        n_cmp = 0 if length < 32 else (length - 32) // 16 + 1
        blocks = -(-length // 64)
        selected = length if blocks <= cfg.num_selected_blocks else 64 * (cfg.num_selected_blocks - 1) + length - 64 * (blocks - 1)
        return n_cmp + selected + min(length, cfg.sliding_window)
    for context in (1, 31, 32, 300, 321):
        assert nsa_keys_attended(cfg, context) == sum(keys(n) for n in range(1, context + 1))


@pytest.mark.gpu
def test_nsa_fast_prefill_at_real_shapes_agrees_with_the_reference_in_bf16():
    """On the GPU in bf16 at the benchmark's NSA attention (64 / 4 heads of 128, 16 blocks of 64,
    window 512), two layers, 5000 tokens in chunks of 2048: the last logits within bf16's tolerance."""
    from benchmarks.bench_prefill import NSA
    with torch.device("cuda"):
        model = build_model(config_from_dict(dict(NSA, num_hidden_layers=2, hidden_size=1024, intermediate_size=2048)))
    randomize_(model, seed=0, on_device=True)
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 5000), device="cuda")
    (ref, _), (fast, _) = both(model, ids, 2048)
    error = (fast[0, -1].float() - ref[0, -1].float()).abs().max() / ref[0, -1].float().abs().max()
    assert error < 3e-2, error


def test_per_head_matmul_writes_a_strided_view_in_place():
    """The absorbed prefill's batched matmul over heads: x [B, S, H, I] (a view of a wider tensor, as
    q_nope is) times w [H, I, O] into out, a view of the first O columns of a wider buffer: the
    einsum's values there (float32 rounding), the buffer's other columns untouched."""
    from hisparse.dsa.model import per_head_matmul
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(2, 5, 3, 24, generator=gen)
    x = wide[..., :16]                                              # [2, 5, 3, 16], row stride 24
    w = torch.randn(3, 16, 8, generator=gen)
    buf = torch.full((2, 5, 3, 11), 7.0)
    per_head_matmul(x, w, buf[..., :8])
    assert torch.allclose(buf[..., :8], torch.einsum("bshn,hnc->bshc", x, w), atol=1e-5)
    assert (buf[..., 8:] == 7.0).all()
    out = torch.empty(2, 5, 3, 16)                                 # a transposed weight, as for the values
    per_head_matmul(buf[..., :8].contiguous(), w.transpose(1, 2), out)
    assert torch.allclose(out, torch.einsum("bshc,hnc->bshn", buf[..., :8], w), atol=1e-5)


@pytest.mark.gpu
def test_gpu_prefill_pieces_never_wait_on_the_gpu():
    """A DSA chunk as prefill pieces (what an overlapping Server launches beside its decode steps)
    under torch's sync debug mode "error": no call reads back from the GPU; the logits are the
    plain fast prefill's bits."""
    from benchmarks.bench_prefill import DSA
    with torch.device("cuda"):
        model = build_model(config_from_dict(dict(DSA, num_hidden_layers=2, first_k_dense_replace=2)))
    randomize_(model, seed=0, on_device=True)
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 3000), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want = model.prefill(ids, model.new_state(1, 3000), fast=True, last_logits=True)
    torch.cuda.synchronize()
    state = model.new_state(1, 3000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pieces = model.prefill_pieces(ids, state, 1, fast=True, last_logits=True, start=0)
        while True:
            try:
                next(pieces)
            except StopIteration as done:
                got = done.value
                break
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
