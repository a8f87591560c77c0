"""The command-line interface `python -m hisparse.generate`: its tokens are the engine's, it reports
timing, miss rate and KV memory, and bad inputs fail with argparse errors naming the value."""
import json
import re
from pathlib import Path

import pytest
import torch

from hisparse.engine import Engine
from hisparse.generate import build_parser, main
from hisparse.models.loading import load_model
from hisparse.models.tiny import write_tiny_checkpoint

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
K = 8                                   # index_topk of the tiny DSA checkpoints
REQUEST = re.compile(r"^request (\d+): prompt \[([\d ]*)\] -> \[([\d ]*)\] \((?:stop|length)\)$", re.MULTILINE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_checkpoint("deepseek_v32", tmp_path_factory.mktemp("dsv32"), seed=1))


@pytest.fixture(scope="module")
def tiny_model(tiny):
    return load_model(tiny, dtype=torch.float32, device=DEVICE)


def cli(capsys, *args):
    """Run the CLI in-process (float32 so the engine run below is comparable on any device)."""
    rc = main([*args, "--dtype", "float32"])
    out, err = capsys.readouterr()
    return rc, out, err


def requests(out):
    """[(prompt ids, generated ids)] as printed."""
    rows = REQUEST.findall(out)
    assert [int(b) for b, _, _ in rows] == list(range(len(rows))), out
    return [([int(t) for t in p.split()], [int(t) for t in g.split()]) for _, p, g in rows]


def field(out, name):
    match = re.search(rf"^{name}\s+(\S+)", out, re.MULTILINE)
    assert match, f"no {name!r} line in:\n{out}"
    return match.group(1)


def test_resident_tokens_equal_the_engine_with_explicit_prompt_ids(tiny, tiny_model, capsys):
    ids = [[5, 17, 3, 9, 60, 2, 8, 1, 44, 90], [7, 7]]    # one longer than k, one shorter
    rc, out, err = cli(capsys, "--model", tiny, "--prompt-ids", "5,17,3,9,60,2,8,1,44,90;7,7",
                       "--new-tokens", "3", "--mode", "resident")
    assert rc == 0, err
    printed = requests(out)
    assert [p for p, _ in printed] == ids
    want = Engine(tiny_model, "resident").generate(ids, new_tokens=3, keep_logits=False)
    assert [g for _, g in printed] == want.tokens.tolist()
    assert float(field(out, "tokens/s")) > 0 and float(field(out, "TPOT")) > 0
    assert "2 requests x 1 timed decode steps" in out          # the first decode step warms up
    assert "miss rate" not in out
    assert f"({want.kv_bytes_per_request:,.0f} bytes) per request" in out


def test_sampling_flags_give_the_engines_sampled_tokens_and_logprobs(tiny, tiny_model, capsys):
    from hisparse.sampling import SamplingParams
    rc, out, err = cli(capsys, "--model", tiny, "--prompt-ids", "5,17,3,9;7,7,1", "--new-tokens", "4", "--seed", "3",
                       "--temperature", "1.2", "--top-p", "0.9", "--top-k", "50", "--logprobs", "2")
    assert rc == 0, err
    want = Engine(tiny_model, "resident").generate(
        [[5, 17, 3, 9], [7, 7, 1]], 4, keep_logits=False,
        sampling=[SamplingParams(1.2, 0.9, 50, seed=3 + b, logprobs=2) for b in range(2)])
    assert [g for _, g in requests(out)] == want.tokens.tolist()
    assert len(re.findall(r"^  token \d: \d+ logprob -?\d", out, re.MULTILINE)) == 8
    rc, _, err = cli(capsys, "--model", tiny, "--top-p", "1.5")
    assert rc == 2 and "argument --top-p: top_p=1.5: expected a finite number in (0, 1]" in err
    rc, _, err = cli(capsys, "--model", tiny, "--top-k", "x")
    assert rc == 2 and "argument --top-k: must be an integer (0 or -1: every token), got 'x'" in err
    sampled = {}
    for k in ("-1", "0"):
        rc, out, err = cli(capsys, "--model", tiny, "--prompt-ids", "5,17,3,9", "--new-tokens", "3",
                           "--temperature", "1.2", "--top-k", k)
        assert rc == 0, err
        sampled[k] = [g for _, g in requests(out)]
    assert sampled["-1"] == sampled["0"] and sampled["0"]               # -1 is 0: every token, as over HTTP


def test_progress_lines_go_to_stderr_and_the_kv_line_names_the_device_used(tiny, capsys, monkeypatch):
    """A run in the interpreter takes 18 to 99 s; it used to print nothing until the end, and "KV on GPU"
    on a CPU."""
    monkeypatch.setattr("hisparse.engine.PROGRESS_EVERY_S", 0.0)     # every decode step's line
    rc, out, err = cli(capsys, "--model", tiny, "--prompt-lens", "9,5", "--new-tokens", "3")
    assert rc == 0, err
    stages = [re.fullmatch(r"\[ *\d+\.\d s\] (.*)", line).group(1) for line in err.splitlines()]
    assert stages == [f"loading {tiny} (float32, {DEVICE})", "prefill of 2 prompts (14 tokens)",
                      "prefilled; 2 decode steps", "decode step 1 of 2", "decode step 2 of 2", "done"]
    assert f"KV on {'GPU' if HAS_GPU else 'CPU'}   " in out and ("KV on GPU" in out) == HAS_GPU


def test_the_reference_prefill_is_the_engines_and_gives_the_same_tokens(tiny, tiny_model, capsys, monkeypatch):
    """--prefill reference runs the eager torch prefill (the model's prefill is called with fast=False,
    fast=True by default): the engine's tokens with prefill="reference", and (on this tiny model in
    float32) the same greedy tokens as the kernels' prefill."""
    from hisparse.models.base import CausalLM
    prefill, fast = CausalLM.prefill, []

    def spy(self, *args, **kwargs):
        fast.append(kwargs.get("fast"))
        return prefill(self, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "prefill", spy)
    ids = [[5, 17, 3, 9, 60, 2, 8, 1, 44, 90]]
    runs = []
    for option in ("reference", "model"):
        rc, out, err = cli(capsys, "--model", tiny, "--prompt-ids", "5,17,3,9,60,2,8,1,44,90", "--new-tokens", "3",
                           "--mode", "resident", "--prefill", option)
        assert rc == 0, err
        runs.append([g for _, g in requests(out)])
    assert fast == [False, True]
    want = Engine(tiny_model, "resident", prefill="reference").generate(ids, new_tokens=3, keep_logits=False)
    assert runs[0] == want.tokens.tolist() == runs[1]


def test_hisparse_tokens_equal_the_engine_and_miss_rate_is_printed(tiny, tiny_model, capsys):
    rc, out, err = cli(capsys, "--model", tiny, "--prompt-lens", "11,4", "--seed", "3", "--new-tokens", "4",
                       "--mode", "hisparse", "--cache-slots", str(K))
    assert rc == 0, err
    printed = requests(out)
    prompts = [p for p, _ in printed]
    assert [len(p) for p in prompts] == [11, 4]
    assert all(0 <= t < tiny_model.config.vocab_size for p in prompts for t in p)
    want = Engine(tiny_model, "hisparse", cache_slots=K).generate(prompts, new_tokens=4, keep_logits=False)
    assert [g for _, g in printed] == want.tokens.tolist()
    assert want.misses > 0 and want.hits > 0
    assert field(out, "miss rate") == f"{want.miss_rate:.4f}"
    assert f"({want.misses} misses, {want.hits} hits over 3 decode steps)" in out
    assert f"({want.kv_bytes_per_request:,.0f} bytes) per request" in out
    assert "2 requests x 2 timed decode steps" in out
    assert f"cache slots B={K} (1k)" in out


def test_random_prompts_are_seeded_and_per_request(tiny, capsys):
    """One new token: prefill only, no timed step."""
    runs = {}
    for seed in (1, 1, 2):
        rc, out, err = cli(capsys, "--model", tiny, "--prompt-len", "6", "--batch", "2", "--new-tokens", "1",
                           "--seed", str(seed))
        assert rc == 0, err
        prompts = [p for p, _ in requests(out)]
        assert [len(p) for p in prompts] == [6, 6] and prompts[0] != prompts[1]
        runs.setdefault(seed, []).append(prompts)
    assert runs[1][0] == runs[1][1] != runs[2][0]
    assert "tokens/s    n/a" in out


def test_one_prompt_is_repeated_over_the_batch_and_long_lists_are_truncated(tiny, capsys):
    rc, out, err = cli(capsys, "--model", tiny, "--prompt-ids", ",".join(map(str, range(20))), "--batch", "3",
                       "--new-tokens", "1", "--show-tokens", "4")
    assert rc == 0, err
    assert out.count("request ") == 3
    assert out.count("prompt [0 1 2 3 ... (+16 more)]") == 3


@pytest.mark.parametrize("args,message", [
    (["--mode", "hisparse", "--cache-slots", "4"], "cache_slots B=4 is smaller than the selection size k=8"),
    (["--mode", "noio"], "noio needs --cache-slots B with B >= k = 8"),
    (["--prompt-len", "4", "--prompt-ids", "1,2"], "argument --prompt-ids: not allowed with argument --prompt-len"),
    (["--prompt-ids", "1,x"], "token id 'x' in '1,x' is not an integer"),
    (["--prompt-ids", "1,97"], "token id 97 is out of range: the vocabulary has 97 ids"),
    (["--prompt-lens", "3,4", "--batch", "3"], "--batch: 3 differs from the 2 lengths of --prompt-lens"),
    (["--new-tokens", "0"], "argument --new-tokens: must be a positive integer, got '0'"),
    (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    (["--prompt-len", "10", "--new-tokens", "4", "--max-context", "12"], "--max-context: 12 is too small"),
    (["--prefetch"], "--prefetch: applies to --mode hisparse, got --mode resident"),
    (["--mode", "hisparse", "--cache-slots", "8", "--prefetch"],
     "(deepseek_v32) has none (glm_moe_dsa's indexer_types 'shared'"),
    (["--token-budget", "48"], ("--token-budget: applies to Quest checkpoints (llama, qwen3), not model_type "
                               "'deepseek_v32'")),
], ids=["slots<k", "no-slots", "both-prompts", "bad-id", "id>=vocab", "batch-mismatch", "zero-tokens",
        "bad-mode", "max-context", "prefetch-resident", "prefetch-no-shared-layers", "budget-dsa"])
def test_bad_arguments_fail_with_argparse_errors(tiny, capsys, args, message):
    rc, out, err = cli(capsys, "--model", tiny, *args)
    assert rc == 2
    assert message in err and "usage: python -m hisparse.generate" in err
    assert "request 0" not in out and "Traceback" not in err


def test_unsupported_family_names_the_model_type(tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    rc, _, err = cli(capsys, "--model", str(gpt2))
    assert rc == 2
    assert "model_type 'gpt2'" in err and "deepseek_v32, glm_moe_dsa, llama, qwen3, nsa" in err
    rc, _, err = cli(capsys, "--model", str(tmp_path / "absent"))
    assert rc == 2 and "no config.json in checkpoint directory" in err


def test_a_bad_checkpoint_folder_prints_the_error_line_alone(tmp_path, capsys):
    """The arguments parsed; the folder is at fault: argparse's usage would only hide the one line that matters."""
    rc, out, err = cli(capsys, "--model", str(tmp_path / "absent"))
    assert rc == 2 and out == ""
    assert err == (f"python -m hisparse.generate: error: argument --model: no config.json in checkpoint directory "
                   f"{str(tmp_path / 'absent')!r}\n")


@pytest.mark.skipif(HAS_GPU, reason="checks the error without a GPU")
def test_graph_and_cuda_need_a_gpu(tiny, capsys):
    rc, _, err = cli(capsys, "--model", tiny, "--graph")
    assert rc == 2 and "argument --graph: CUDA graphs need a CUDA GPU" in err
    rc, _, err = cli(capsys, "--model", tiny, "--device", "cuda")
    assert rc == 2 and "argument --device: 'cuda' needs a CUDA GPU" in err


def test_the_cpu_is_refused_where_a_gpu_is_visible(tiny, capsys, monkeypatch):
    """--device cpu where the process sees a GPU: its kernels were compiled for the GPU, not for Triton's
    interpreter (kernels_triton chose at import), so the CLI refuses and says how to run on the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)       # as a GPU machine's process sees it
    rc, out, err = cli(capsys, "--model", tiny, "--device", "cpu")
    assert rc == 2 and "argument --device: cpu runs the kernels in Triton's interpreter" in err
    assert "run with CUDA_VISIBLE_DEVICES= instead" in err and "request 0" not in out


def test_help_explains_every_option(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m hisparse.make_tiny --family deepseek_v32 --out /tmp/tiny" in out
    assert "python -m hisparse.generate --model /tmp/tiny" in out
    for action in build_parser()._actions:
        assert action.help and len(action.help) > 10, action.option_strings
        for option in action.option_strings:
            assert option in out
    for option in ("--model", "--prompt-len", "--prompt-ids", "--prompt-lens", "--new-tokens", "--batch", "--mode",
                   "--cache-slots", "--prefetch", "--graph", "--dtype", "--device", "--chunk-size", "--max-context",
                   "--seed"):
        assert option in out


# -- Quest and NSA checkpoints ------------------------------------------------------------------

QUEST_BUDGET = 48                       # tokens: k = 3 pages per KV head


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=1))


@pytest.fixture(scope="module")
def tiny_nsa(tmp_path_factory):
    """The kernels' block sizes, k = 4 blocks, a 64-token window, one layer (short interpreter runs)."""
    return str(write_tiny_checkpoint("nsa", tmp_path_factory.mktemp("nsa"), seed=1, num_hidden_layers=1,
                                     num_selected_blocks=4, sliding_window=64))


def test_prefetch_runs_for_a_quest_checkpoint_with_shared_selections(tmp_path, capsys):
    """--prefetch on a Quest checkpoint whose Quest layers share a selection (quest_selection_group 2:
    layers 2 and 3): the engine's tokens, with the same misses."""
    path = str(write_tiny_checkpoint("llama", tmp_path, seed=1, num_hidden_layers=4, quest_selection_group=2))
    rc, out, err = cli(capsys, "--model", path, "--prompt-lens", "40,21", "--new-tokens", "3", "--show-tokens", "40",
                       "--mode", "hisparse", "--cache-slots", "3", "--token-budget", "48", "--prefetch")
    assert rc == 0, err
    printed = requests(out)
    model = load_model(path, dtype=torch.float32, device=DEVICE)
    want = Engine(model, "hisparse", cache_slots=3, token_budget=48, prefetch=True).generate(
        [p for p, _ in printed], new_tokens=3, keep_logits=False)
    assert [g for _, g in printed] == want.tokens.tolist() and want.misses > 0
    assert field(out, "miss rate") == f"{want.miss_rate:.4f}"


def test_quest_tokens_equal_the_engine_with_a_token_budget(tiny_llama, capsys):
    rc, out, err = cli(capsys, "--model", tiny_llama, "--prompt-lens", "40,21", "--new-tokens", "3",
                       "--show-tokens", "40", "--mode", "hisparse", "--token-budget", str(QUEST_BUDGET),
                       "--cache-slots", "3")
    assert rc == 0, err
    printed = requests(out)
    model = load_model(tiny_llama, dtype=torch.float32, device=DEVICE)
    want = Engine(model, "hisparse", cache_slots=3, token_budget=QUEST_BUDGET).generate(
        [p for p, _ in printed], new_tokens=3, keep_logits=False)
    assert [g for _, g in printed] == want.tokens.tolist()
    assert want.misses > 0
    assert field(out, "miss rate") == f"{want.miss_rate:.4f}"
    assert "(llama, Quest, 3 layers, k=3 (token_budget // 16 pages)" in out


def test_nsa_tokens_equal_the_engine(tiny_nsa, capsys):
    """The eager prefill (--prefill reference): NSA's kernel prefill, half of each run in the interpreter
    here, is tests/test_prefill.py's, and the command passes --prefill on as the other families' tests
    check."""
    rc, out, err = cli(capsys, "--model", tiny_nsa, "--prompt-lens", "330,20", "--new-tokens", "3",
                       "--show-tokens", "330", "--mode", "hisparse", "--cache-slots", "4", "--prefill", "reference")
    assert rc == 0, err
    printed = requests(out)
    model = load_model(tiny_nsa, dtype=torch.float32, device=DEVICE)
    want = Engine(model, "hisparse", cache_slots=4, prefill="reference").generate([p for p, _ in printed],
                                                                                  new_tokens=3, keep_logits=False)
    assert [g for _, g in printed] == want.tokens.tolist()
    assert want.misses > 0
    assert field(out, "miss rate") == f"{want.miss_rate:.4f}"
    assert f"({want.kv_bytes_per_request:,.0f} bytes) per request" in out
    assert "(nsa, NSA, 1 layers, k=4 (num_selected_blocks)" in out


@pytest.mark.parametrize("family,args,message", [
    ("llama", ["--mode", "hisparse", "--cache-slots", "2", "--token-budget", "48"],
     "cache_slots B=2 is smaller than the selection size k=3 (token_budget // 16 pages)"),
    ("llama", ["--mode", "noio", "--token-budget", "48"], "noio needs --cache-slots B with B >= k = 3"),
    ("llama", ["--token-budget", "8"], "argument --token-budget: 8 is under one page (16 tokens)"),
    ("llama", ["--mode", "hisparse", "--cache-slots", "3", "--prefetch"],
     "argument --prefetch: replays an anchor's miss plan in shared layers; checkpoint"),
    ("nsa", ["--mode", "hisparse", "--cache-slots", "3"],
     "cache_slots B=3 is smaller than the selection size k=4 (num_selected_blocks)"),
    ("nsa", ["--token-budget", "64"], ("--token-budget: applies to Quest checkpoints (llama, qwen3), not "
                                      "model_type 'nsa'")),
], ids=["quest-slots<k", "quest-no-slots", "quest-budget<page", "quest-prefetch", "nsa-slots<k", "nsa-budget"])
def test_bad_quest_and_nsa_arguments_fail_with_argparse_errors(tiny_llama, tiny_nsa, capsys, family, args,
                                                              message):
    rc, out, err = cli(capsys, "--model", {"llama": tiny_llama, "nsa": tiny_nsa}[family], *args)
    assert rc == 2
    assert message in err and "usage: python -m hisparse.generate" in err
    assert "request 0" not in out and "Traceback" not in err


def test_nsa_checkpoint_off_the_kernel_sizes_is_refused(tmp_path, capsys):
    nsa = write_tiny_checkpoint("nsa", tmp_path / "nsa", selection_block_size=32)
    rc, _, err = cli(capsys, "--model", str(nsa))
    assert rc == 2
    assert "does not fit the NSA kernels: the NSA kernels are built for selection_block_size 64" in err


# -- bad config.json values and seeds (issue #37) ----------------------------------------------------

def _edit_config(path, edits, drop=()):
    config = Path(path) / "config.json"
    raw = {k: v for k, v in json.loads(config.read_text()).items() if k not in drop}
    config.write_text(json.dumps(dict(raw, **edits)))
    return str(path)


@pytest.mark.parametrize("family,edits,drop,message", [
    ("llama", {"rms_norm_eps": "1e-6"}, (), "config rms_norm_eps must be a positive number, found '1e-6'"),
    ("deepseek_v32", {"routed_scaling_factor": "2.5"}, (),
     "config routed_scaling_factor must be a positive number, found '2.5'"),
    ("llama", {"rope_theta": "10000"}, ("rope_parameters",), "rope_theta must be a positive number, found '10000'"),
    ("deepseek_v32", {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 64}},
     ("rope_parameters",), "rope_scaling of rope_type 'yarn' lacks 'factor'"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 64,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     ("rope_parameters",), "rope_scaling of rope_type 'llama3' lacks 'factor'"),
    ("llama", {"quest_dense_layers": -1}, (), "quest_dense_layers must be an int from 0 to num_hidden_layers 3"),
    ("llama", {"quest_dense_layers": 4}, (), "quest_dense_layers must be an int from 0 to num_hidden_layers 3"),
    ("llama", {"model_type": ["llama"]}, (), "model_type ['llama']"),
    ("deepseek_v32", {"num_experts_per_tok": 5}, (), "config num_experts_per_tok 5 must be at most n_routed_experts 4"),
    ("deepseek_v32", {"topk_group": 3}, (), "config topk_group 3 must be at most n_group 2"),
], ids=["str-eps", "str-scaling", "str-theta", "yarn-no-factor", "llama3-no-factor", "negative-dense-layers",
        "dense-layers>layers", "list-model-type", "top-k>experts", "topk-group>groups"])
def test_bad_config_values_fail_as_a_bad_model(family, edits, drop, message, tmp_path, capsys):
    """These used to load and then raise a TypeError or KeyError inside the first forward (a traceback), or
    run with a negative quest_dense_layers read two ways."""
    path = _edit_config(write_tiny_checkpoint(family, tmp_path), edits, drop)
    rc, out, err = cli(capsys, "--model", path, "--prompt-len", "4", "--new-tokens", "1")
    assert rc == 2, err
    assert "argument --model: " in err and message in err and "usage:" not in err
    assert "request 0" not in out and "Traceback" not in err


def test_a_nan_weight_fails_as_a_bad_model_naming_the_tensor(tmp_path, capsys):
    """It used to run to NaN logits and print token 0 for every new token."""
    from safetensors.torch import load_file, save_file
    path = write_tiny_checkpoint("deepseek_v32", tmp_path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"][3, 2] = float("nan")
    save_file(tensors, path / "model.safetensors")
    rc, out, err = cli(capsys, "--model", str(path), "--prompt-len", "4", "--new-tokens", "2")
    assert rc == 2 and "request 0" not in out and "Traceback" not in err
    assert (f"error: argument --model: cannot load checkpoint {str(path)!r}: tensor lm_head.weight in "
            f"model.safetensors holds 1 non-finite values (nan at [3, 2]): expected finite weights") in err


def test_unknown_config_keys_are_printed_as_warnings(tmp_path, capsys):
    path = _edit_config(write_tiny_checkpoint("llama", tmp_path), {"rope_thetaa": 5e5, "quest_dense_layers": -1})
    rc, _, err = cli(capsys, "--model", path)
    assert rc == 2
    assert "warning: " in err and "'rope_thetaa' (did you mean 'rope_theta'?)" in err
    assert err.index("warning: ") < err.index("argument --model: ")


@pytest.mark.parametrize("seed", ["99999999999999999999", str(2**64), "-1"])
def test_seeds_beyond_64_bits_are_argparse_errors(tiny, capsys, seed):
    rc, out, err = cli(capsys, "--model", tiny, "--seed", seed)
    assert rc == 2 and "Traceback" not in err and "request 0" not in out
    assert f"argument --seed: must be an integer from 0 to 2**64 - 1 = {2**64 - 1}, got {seed!r}" in err


def test_the_largest_seed_is_accepted():
    assert build_parser().parse_args(["--model", "x", "--seed", str(2**64 - 1)]).seed == 2**64 - 1


@pytest.fixture(scope="module")
def texty(tmp_path_factory):
    return str(write_tiny_checkpoint("deepseek_v32", tmp_path_factory.mktemp("text"), seed=1, tokenizer=True,
                                     num_hidden_layers=1))


def test_a_text_prompt_prints_its_text_and_a_stop_string_cuts_it(texty, capsys):
    """--prompt encodes with the checkpoint's tokenizer, the tokens come back as text; --stop ends the text
    where the stop begins (left out), the ids cut at the token that completed it, finish reason stop."""
    import ast

    def text_of(out):
        line = next(x for x in out.splitlines() if x.startswith("  text: "))
        return ast.literal_eval(line.rsplit(" -> ", 1)[1])
    args = ["--model", texty, "--prompt", "The cache keeps", "--new-tokens", "8", "--ignore-eos", "--seed", "3"]
    rc, out, _ = cli(capsys, *args)
    text = text_of(out)
    assert rc == 0 and "(length)" in out and len(text.strip()) >= 3, out
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    rc, cut, _ = cli(capsys, *args, "--stop", stop)
    assert rc == 0 and text_of(cut) == text[:text.find(stop)] and "(stop)" in cut, cut


@pytest.mark.parametrize("args,message", [
    (["--prompt", "a\udcff"], "argument --prompt: the text holds a lone surrogate"),    # undecodable argv bytes
    (["--prompt", "ab", "--new-tokens", "2", "--min-tokens", "3"], "argument --min-tokens: 3 is over --new-tokens 2"),
    (["--prompt", "ab", "--stop", ""], "argument --stop: an empty string"),
], ids=str)
def test_bad_text_arguments_fail_with_argparse_errors(texty, capsys, args, message):
    rc, out, err = cli(capsys, "--model", texty, *args)
    assert rc == 2 and message in err and "Traceback" not in err, err


def test_text_options_need_a_tokenizer(tiny, capsys):
    assert main(["--model", tiny, "--prompt", "hello"]) == 2
    assert "argument --prompt: checkpoint" in capsys.readouterr().err
    assert main(["--model", tiny, "--prompt-ids", "1,2", "--stop", "x"]) == 2
    assert "argument --stop: checkpoint" in capsys.readouterr().err
