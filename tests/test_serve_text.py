"""Text over HTTP (python -m hisparse.serve on a tiny checkpoint with its tokenizer): the official
openai client's completions and chat completions, streamed and not, with sampling settings, stop
strings and logprobs (streamed texts equal the non-streamed); stop strings split across tokens and
across streamed chunks (held back while they may start); prompts as text or ids; echo; logprobs
against the model's logits; every bad setting a 400 naming its field."""
import asyncio
import json

import aiohttp
import pytest
import torch
from test_serve_http import Running, answer, assert_error, events, run

from hisparse.models.loading import load_model
from hisparse.models.tiny import write_tiny_checkpoint
from hisparse.sampling import SamplingParams
from hisparse.serve import bench
from hisparse.serving import Request, Server
from hisparse.text import StopMatcher, TextStream, load_tokenizer

FAMILY = "deepseek_v32"
MAX_CONTEXT = 40
PROMPT = "The hot cache"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(FAMILY, tmp_path_factory.mktemp("text") / "tiny", tokenizer=True, num_hidden_layers=2)


@pytest.fixture(scope="module")
def texty(checkpoint):
    model = load_model(checkpoint)
    server = Server(model, "resident", max_context=MAX_CONTEXT, kv_budget_gib=0.05, max_batch=3, prefill_chunk=32,
                    prefill="reference", keep_logits=True)
    running = Running(server, tokenizer=load_tokenizer(checkpoint))
    yield running
    running.shut_down()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


def client_of(running):
    import openai
    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0, timeout=60)


def pieces_of(tokenizer, prompt_ids: list[int], tokens: list[int]) -> list[str]:
    """Each token's piece of text, as the server's detokenisation hands them out (the last with what
    was held back till the end)."""
    stream = TextStream(tokenizer, prompt_ids)
    pieces = [stream.add(t, n)[0] for n, t in enumerate(tokens, 1)]
    pieces[-1] += stream.finish(len(tokens))[0]
    return pieces


def stop_across(pieces: list[str], width: int) -> tuple[str, int]:
    """A stop string made of the last character of a piece, `width - 2` whole pieces and the first
    character of the next, placed where it first occurs in the text; the number of tokens that
    completes it."""
    text = "".join(pieces)
    for k in range(len(pieces) - width + 1):
        window = pieces[k:k + width]
        stop = window[0][-1:] + "".join(window[1:-1]) + window[-1][:1]
        if all(window) and REPLACEMENT not in stop:
            start = sum(map(len, pieces[:k + 1])) - 1
            if text.find(stop) == start:
                return stop, k + width
    raise AssertionError(f"no {width} pieces in a row to make a stop of: {pieces}")


SETTINGS = [dict(), dict(temperature=0.8, top_p=0.9, seed=11), dict(temperature=1.0, seed=3, logprobs=2)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "top_p", "logprobs"])
def test_the_openai_client_completes_text_streamed_and_not_alike_and_stops(texty, tokenizer, settings):
    client = client_of(texty)
    ids = {"extra_body": {"return_token_ids": True, "ignore_eos": True}}    # lengths as asked, with a sampler
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, **settings, **ids)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stream=True, **settings,
                                            **ids))
    text = full.choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == text and text
    assert [c.choices[0].finish_reason for c in chunks][-1] == full.choices[0].finish_reason
    tokens = full.choices[0].token_ids
    assert [t for c in chunks for t in c.choices[0].token_ids] == tokens and text == tokenizer.decode(tokens)
    assert [c.choices[0].text for c in chunks] == pieces_of(tokenizer, tokenizer.encode(PROMPT), tokens)
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) and full.usage.completion_tokens == len(tokens)
    if "logprobs" in settings:
        streamed = [c.choices[0].logprobs for c in chunks]
        assert [lp for s in streamed for lp in s.token_logprobs] == full.choices[0].logprobs.token_logprobs
        assert len(full.choices[0].logprobs.tokens) == len(tokens)
    stop, n = stop_across(pieces_of(tokenizer, tokenizer.encode(PROMPT), tokens), 2)
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stop=[stop, "never"],
                                        **settings, **ids)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stop=stop, stream=True,
                                            **settings, **ids))
    assert stopped.choices[0].text == text[:text.find(stop)] == "".join(c.choices[0].text for c in chunks)
    assert stopped.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    assert stopped.choices[0].token_ids == tokens[:n]               # it stopped at once: no token after the stop
    assert texty.server.requests[-1].tokens == tokens[:n]


def test_the_openai_client_chats_streamed_and_not_alike(texty, tokenizer):
    client = client_of(texty)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    settings = dict(temperature=0.7, top_p=0.95, seed=5, logprobs=True, top_logprobs=2, max_tokens=6,
                    extra_body={"ignore_eos": True})
    full = client.chat.completions.create(model="tiny", messages=messages, **settings)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **settings))
    content = full.choices[0].message.content
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.choices[0].message.role == \
        "assistant"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == content and content
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    _, ids = tokenizer.chat(messages)
    assert full.usage.prompt_tokens == len(ids) == chunks[-1].usage.prompt_tokens
    assert full.usage.completion_tokens == 6 == chunks[-1].usage.completion_tokens
    entries = full.choices[0].logprobs.content
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)
    assert [e.logprob for c in chunks[1:-1] for e in c.choices[0].logprobs.content] == [e.logprob for e in entries]
    assert all(bytes(e.bytes).decode(errors="replace") == e.token for e in entries)   # a piece of a character: U+FFFD
    for seed in range(5, 40):       # a sampled text with whole characters across two tokens to stop at
        seeded = dict(settings, seed=seed)
        content = client.chat.completions.create(model="tiny", messages=messages, **seeded).choices[0].message.content
        try:
            stop, n = stop_across(pieces_of(tokenizer, ids, texty.server.requests[-1].tokens), 2)
            break
        except AssertionError:
            continue
    else:
        raise AssertionError("no seed in 5..39 samples a text with a stop across two tokens")
    stopped = client.chat.completions.create(model="tiny", messages=messages, stop=stop, **seeded)
    assert stopped.choices[0].message.content == content[:content.find(stop)]
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == n


def test_a_seed_gives_the_same_text_twice_and_in_hisparse_mode(texty, checkpoint):
    """temperature and top_p on, one seed: the same text from the resident server twice and from a
    hisparse one (each request alone in its batch: bitwise the same logits, so the same draws)."""
    hier = Running(Server(load_model(checkpoint), "hisparse", cache_slots=16, max_context=MAX_CONTEXT,
                          kv_budget_gib=0.05, max_batch=3, prefill_chunk=32, prefill="reference"),
                   tokenizer=load_tokenizer(checkpoint))
    try:
        texts = [client_of(running).completions.create(
            model="tiny", prompt="The cache keeps", max_tokens=8, temperature=0.9, top_p=0.9, seed=11,
            extra_body={"ignore_eos": True}).choices[0].text for running in (texty, texty, hier)]
        other = client_of(hier).completions.create(model="tiny", prompt="The cache keeps", max_tokens=8,
                                                   temperature=0.9, top_p=0.9, seed=12,
                                                   extra_body={"ignore_eos": True}).choices[0].text
    finally:
        hier.shut_down()
    assert texts[0] and texts[0] == texts[1] == texts[2], texts
    assert hier.server.requests[-1].sampling.seed == 12 and other != texts[0], "the seed is not what samples"


def test_the_settings_reach_the_request(texty):
    """Every sampling setting of a body is the request's SamplingParams (the sampler's input)."""
    body = {"temperature": 0.5, "top_p": 0.8, "top_k": 3, "min_p": 0.1, "seed": 9, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "logit_bias": {"5": 1.5}, "logprobs": 2, "stop_token_ids": [7],
            "ignore_eos": True, "min_tokens": 1}

    async def go():
        async with aiohttp.ClientSession() as s:
            done = await answer(s, "POST", f"{texty.url}/v1/completions", json=dict(body, prompt="x", max_tokens=1))
            chat = await answer(s, "POST", f"{texty.url}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "top_k": -1,
                                      "logprobs": True, "top_logprobs": 4, "seed": 1})
            return done, chat
    (status, _, _), (chat_status, _, _) = run(go())
    assert status == chat_status == 200
    completion, chat = texty.server.requests[-2:]
    assert completion.sampling == SamplingParams(**dict(body, logit_bias={5: 1.5}, stop_token_ids=(7,)))
    assert chat.sampling == SamplingParams(top_k=0, logprobs=4, seed=1)


def test_a_chat_without_max_tokens_fills_the_context(texty, tokenizer):
    async def go():
        async with aiohttp.ClientSession() as s:
            return await answer(s, "POST", f"{texty.url}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                                      "ignore_eos": True})
    status, _, body = run(go())
    prompt = len(tokenizer.chat([{"role": "user", "content": "Hi"}])[1])
    assert status == 200 and body["usage"] == {"prompt_tokens": prompt, "completion_tokens": MAX_CONTEXT - prompt,
                                               "total_tokens": MAX_CONTEXT}


async def stream_texts(session, url: str, body: dict) -> list[dict]:
    async with session.post(f"{url}/v1/completions", json=dict(body, stream=True, ignore_eos=True)) as response:
        assert response.status == 200
        return await events(response)


def test_stop_strings_split_across_streamed_chunks_are_held_back(texty, tokenizer):
    """A stop over three tokens: the chunk of its first token holds back its last character, the
    next says "" (all of it may be the stop), the third finishes "stop". A stop that never
    completes gives the held text back with the next chunk."""
    prompt = tokenizer.encode(PROMPT)

    async def go():
        async with aiohttp.ClientSession() as s:
            plain = await stream_texts(s, texty.url, {"prompt": prompt, "max_tokens": 10, "return_token_ids": True})
            tokens = [t for e in plain[:-1] for t in e["choices"][0]["token_ids"]]
            pieces = pieces_of(tokenizer, prompt, tokens)
            stop, n = stop_across(pieces, 3)
            stopped = await stream_texts(s, texty.url, {"prompt": prompt, "max_tokens": 10, "stop": stop})
            k = n - 3
            never = pieces[k][-1] + "\x00"
            held = await stream_texts(s, texty.url, {"prompt": prompt, "max_tokens": 10, "stop": never})
            return pieces, stop, n, stopped, held
    pieces, stop, n, stopped, held = run(go())
    text, k = "".join(pieces), n - 3
    texts = [e["choices"][0]["text"] for e in stopped[:-1]]
    matcher = StopMatcher((stop,))
    assert texts == [matcher.add(p, i)[0] for i, p in enumerate(pieces[:n], 1)], (stop, pieces)
    assert texts[-2:] == ["", ""] and "".join(texts) == text[:text.find(stop)] and len(texts) == n
    assert stopped[-2]["choices"][0]["finish_reason"] == "stop" and stopped[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in held[:-1]]
    assert len("".join(texts[:k + 1])) == len("".join(pieces[:k + 1])) - 1 and texts[k + 1].startswith(pieces[k][-1])
    assert "".join(texts) == text


def test_prompts_as_text_or_ids_and_echo(texty, tokenizer):
    other = "Two lanes"
    a, b = tokenizer.encode(PROMPT), tokenizer.encode(other)

    async def go():
        async with aiohttp.ClientSession() as s:
            url = f"{texty.url}/v1/completions"
            forms = [await answer(s, "POST", url, json={"prompt": p, "max_tokens": 3})
                     for p in ([PROMPT, other], [a, b], PROMPT, a)]
            echo = await answer(s, "POST", url, json={"prompt": PROMPT, "max_tokens": 3, "echo": True})
            streamed = await stream_texts(s, texty.url, {"prompt": a, "max_tokens": 3, "echo": True})
            return forms, echo, streamed
    forms, echo, streamed = run(go())
    assert all(status == 200 for status, _, _ in forms)
    texts = [[c["text"] for c in body["choices"]] for _, _, body in forms]
    assert texts[0] == texts[1] and texts[2] == texts[3] == texts[0][:1]
    assert "token_ids" not in forms[0][2]["choices"][0]                  # ids on return_token_ids only
    assert forms[0][2]["usage"]["prompt_tokens"] == len(a) + len(b)
    assert echo[2]["choices"][0]["text"] == PROMPT + texts[0][0]
    assert streamed[0]["choices"][0]["text"] == tokenizer.decode(a) == PROMPT
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == PROMPT + texts[0][0]


def test_logprobs_are_the_models(texty, tokenizer):
    """Completions' logprobs (tokens, token_logprobs, top_logprobs, text_offset) and chat's, against
    log_softmax of the logits the server kept for the request."""
    async def go():
        async with aiohttp.ClientSession() as s:
            done = await answer(s, "POST", f"{texty.url}/v1/completions",
                                json={"prompt": PROMPT, "max_tokens": 4, "logprobs": 3, "return_token_ids": True,
                                      "ignore_eos": True})
            kept = texty.server.requests[-1]
            chat = await answer(s, "POST", f"{texty.url}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                      "logprobs": True, "top_logprobs": 1, "ignore_eos": True})
            return done, kept, chat, texty.server.requests[-1]
    (status, _, body), kept, (chat_status, _, chat), chat_kept = run(go())
    assert status == 200 and chat_status == 200
    choice = body["choices"][0]
    logprobs, tokens = choice["logprobs"], choice["token_ids"]
    expected = [torch.log_softmax(logits.reshape(-1), -1) for logits in kept.logits]
    assert logprobs["tokens"] == [tokenizer.token_text(t) for t in tokens]
    assert logprobs["token_logprobs"] == pytest.approx([float(e[t]) for e, t in zip(expected, tokens)], abs=1e-5)
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(tokens))]
    assert logprobs["text_offset"] == offsets and len(tokens) == 4
    for top, e in zip(logprobs["top_logprobs"], expected):
        best = e.topk(3)
        named = {}                          # ids whose texts coincide (pieces of characters) share a key
        for i, v in zip(best.indices.tolist(), best.values.tolist()):
            named[tokenizer.token_text(i)] = v
        assert top == pytest.approx(named, abs=1e-5)
    entries = chat["choices"][0]["logprobs"]["content"]
    expected = [torch.log_softmax(logits.reshape(-1), -1) for logits in chat_kept.logits]
    assert [e["logprob"] for e in entries] == pytest.approx([float(x[t]) for x, t in zip(expected, chat_kept.tokens)],
                                                            abs=1e-5)
    assert [e["top_logprobs"][0]["logprob"] for e in entries] == pytest.approx([float(x.max()) for x in expected],
                                                                               abs=1e-5)


COMPLETION_BAD = [  # (body, param, words)
    ({"temperature": -1}, "temperature", "[0, 100]"),
    ({"top_p": 2}, "top_p", "(0, 1]"),
    ({"top_k": -5}, "top_k", "top_k=-5"),
    ({"min_p": 2}, "min_p", "min_p=2"),
    ({"seed": -1}, "seed", "seed=-1"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": "x"}, "frequency_penalty", "'x'"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"600": 1}}, "logit_bias", "600"),
    ({"logit_bias": {"5": 200}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": [1]}, "logit_bias", "object"),
    ({"logprobs": 25}, "logprobs", "[0, 20]"),
    ({"logprobs": True}, "logprobs", "True"),
    ({"stop": 5}, "stop", "a string or a list"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"stop_token_ids": [9999]}, "stop_token_ids", "9999"),
    ({"stop_token_ids": 3}, "stop_token_ids", "list"),
    ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens=-1"),
    ({"n": 2}, "n", "one choice per prompt"),
    ({"best_of": 3}, "best_of", "best_of"),
    ({"echo": True, "logprobs": 1}, "logprobs", "echo"),
    ({"echo": 1}, "echo", "true or false"),
    ({"suffix": "x"}, "suffix", "suffix"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"return_token_ids": 1}, "return_token_ids", "true or false"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"prompt": ["a", [1]]}, "prompt", "strings only"),
    ({"prompt": ""}, "prompt", "non-empty"),
    ({"prompt": "word " * 60}, "prompt", "max_context=40"),
    ({"prompt": [1, 600]}, "prompt", "0 <= id < 512"),
    ({"prompt": "\ud800"}, "prompt", "lone surrogate"),
    ({"prompt": ["a", "b\udfff"]}, "prompt", "prompt 1"),
    ({"logit_bias": {"\u0661": 1}}, "logit_bias", "not a token id"),          # an Arabic-Indic 1
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "max_tokens=2"),
]
CHAT_BAD = [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages", "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages", "text parts"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "tool_calls"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "messages[0].content: the text holds a lone"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages", "messages[1].content: the text holds a lone surrogate ('\\udc00' at character 0)"),
    ({"max_tokens": 0, "max_completion_tokens": 2}, "max_tokens", ">= 1"),
    ({"min_tokens": 39}, "min_tokens", "max_tokens="),          # over what the context leaves
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "messages[0].role 'wizard'"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages", "messages[0].name"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs", "0 to 20"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
    ({"max_tokens": 100}, "messages", "max_context=40"),
    ({"n": 2}, "n", "one choice per prompt"),
    ({"tools": [{"type": "function"}]}, "tools", "unsupported parameter"),
    ({"temperature": 101}, "temperature", "[0, 100]"),
    ({"stop": [1]}, "stop", "a string or a list"),
    ({"model": "gpt-4o"}, "model", "does not exist"),
]


def test_every_bad_setting_gets_a_400_naming_its_field(texty):
    async def go():
        async with aiohttp.ClientSession() as s:
            completions = [await answer(s, "POST", f"{texty.url}/v1/completions", json=dict({"prompt": "x"}, **body))
                           for body, _, _ in COMPLETION_BAD]
            chats = [await answer(s, "POST", f"{texty.url}/v1/chat/completions",
                                  json=dict({"messages": [{"role": "user", "content": "x"}]}, **body))
                     for body, _, _ in CHAT_BAD]
            return completions, chats
    completions, chats = run(go())
    for got, (body, param, words) in zip(completions + chats, COMPLETION_BAD + CHAT_BAD):
        status = 404 if param == "model" else 400
        assert_error(got, status, param, words, "model_not_found" if status == 404 else None)


def test_a_null_field_is_an_absent_one_even_where_the_field_is_refused(tokenizer):
    """OpenAI's clients send null for "not given": null tools, response_format, audio ... are absent,
    not unsupported parameters (a value there is still refused)."""
    from hisparse.serve.chat import parse_chat
    from hisparse.serve.protocol import BadRequest, parse_completion
    nulls = {"tools": None, "tool_choice": None, "response_format": None, "audio": None, "stream_options": None}
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], **nulls}, 512, "m", MAX_CONTEXT, tokenizer)
    assert len(chat.prompts) == 1
    assert parse_completion({"prompt": "x", **nulls}, 512, "m", MAX_CONTEXT, tokenizer).prompts
    with pytest.raises(BadRequest, match="unsupported parameter 'tools'") as refused:
        parse_completion({"prompt": "x", "tools": []}, 512, "m", MAX_CONTEXT, tokenizer)
    assert refused.value.param == "tools"


def test_repeated_stop_token_ids_are_kept_once():
    from hisparse.serve.protocol import parse_completion
    generation = parse_completion({"prompt": [1], "stop_token_ids": [5, 7] * 50_000}, 512, "m")
    assert generation.sampling.stop_token_ids == (5, 7)


def test_chat_logprobs_bytes_rejoin_a_character_split_across_tokens(tokenizer):
    from hisparse.serve.chat import Chat
    from hisparse.serve.protocol import Generation
    ids = tokenizer.encode("☃")
    generation = Generation([[1]], 3, SamplingParams(logprobs=1), (), False, False)
    content = Chat(generation, tokenizer, "m")._logprobs(ids, [(-1.0, [(t, -1.0)]) for t in ids])["content"]
    assert bytes(sum((entry["bytes"] for entry in content), [])).decode() == "☃"
    assert bytes(sum((entry["top_logprobs"][0]["bytes"] for entry in content), [])).decode() == "☃"


def test_the_load_client_sends_text_and_chat(texty, tmp_path):
    for form in ("text", "chat"):
        rc = bench.main(["--url", texty.url, "--concurrency", "2", "--requests-per-client", "1", "--input-len", "8",
                         "--output-len", "3", "--prompt-format", form, "--out", str(tmp_path)])
        assert rc == 0, form
    import pandas as pd
    rows = pd.read_csv(tmp_path / "serving.csv")
    assert list(rows.drop_duplicates("prompt_format").prompt_format) == ["text", "chat"]
    value = rows[rows.metric == "output_tokens"].value.tolist()
    assert value == [6, 6] and set(rows[rows.metric == "failed_requests"].value) == {0}


def test_the_command_refuses_a_tokenizer_it_cannot_use(checkpoint, tmp_path, capsys):
    """Before serving: --tokenizer at a folder without one, an unreadable tokenizer, and one whose
    ids pass the model's vocabulary (the 512-id tokenizer beside a 97-id model)."""
    from hisparse.serve.__main__ import main as serve_main
    bare = str(write_tiny_checkpoint(FAMILY, tmp_path / "bare", num_hidden_layers=2))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{")
    base = ["--model", bare, "--prefill", "reference", "--port", "0"]
    for argv, words in ((["--tokenizer", bare], "--tokenizer: no tokenizer"),
                        (["--tokenizer", str(tmp_path / "broken")], "cannot be read"),
                        (["--tokenizer", str(checkpoint)], "has 512 ids, over the model's vocabulary of 97")):
        assert serve_main(base + argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err
