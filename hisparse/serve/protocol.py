"""The OpenAI completions format, as far as a greedy token-id server speaks it: a request body
checked field by field (a `BadRequest` names the field and what was expected), and the response,
chunk and error bodies.

Checkpoints here carry no tokenizer, so prompts are token ids and a choice's `text` is its ids
joined by spaces. Decoding is greedy and always runs to `max_tokens` (finish_reason "length"): a
setting that asks for anything else is refused rather than ignored. A null field is an absent one
(what OpenAI's clients send for "not given").
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 256     # prompts a request may carry: 20,000 once held the server thread (and /metrics) for 36 s

# settings a greedy server honours only at these values (what it does anyway), or null or absent
NEUTRAL = {
    "temperature": (0,), "top_p": (1,), "n": (1,), "best_of": (1,),
    "presence_penalty": (0,), "frequency_penalty": (0,),
    "logprobs": (), "echo": (False,), "stop": ([], ""), "suffix": ("",), "logit_bias": ({},), "ignore_eos": (True,),
}
WHY_NOT = {
    "temperature": "decoding is greedy (sampling is not served yet): temperature 0, null or absent",
    "top_p": "decoding is greedy (sampling is not served yet): top_p 1, null or absent",
    "n": "one choice per prompt: n 1, null or absent",
    "best_of": "one choice per prompt: best_of 1, null or absent",
    "presence_penalty": "no penalties: 0, null or absent",
    "frequency_penalty": "no penalties: 0, null or absent",
    "logprobs": "no log-probabilities are returned: null or absent",
    "echo": "the prompt is not echoed: false, null or absent",
    "stop": "generation runs to max_tokens: no stop sequences (null or absent)",
    "suffix": "no suffix: null or absent",
    "logit_bias": "no logit bias: null or absent",
    "ignore_eos": "generation never stops at an end-of-sequence token: true, null or absent",
}
UNUSED = {"user": (str, "a string"), "seed": (int, "an integer")}   # accepted when well-formed, not used


class BadRequest(Exception):
    """A request the server refuses: HTTP `status`, the `param` at fault, the message, OpenAI's `code`."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass
class Completion:
    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    include_usage: bool              # stream_options.include_usage: a last chunk with the counts


def parse_completion(body, vocab_size: int, model: str, max_context: int | None = None) -> Completion:
    """The checked request for the model named `model`; BadRequest naming the first bad field (a
    404 model_not_found for another model's name, as OpenAI's API answers). max_context: a prompt
    that cannot fit it with max_tokens is refused before its ids are read."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got a JSON {type(body).__name__}", None)
    known = {"prompt", "model", "max_tokens", "stream", "stream_options"} | set(NEUTRAL) | set(UNUSED)
    for key in body:
        if key not in known:
            raise BadRequest(f"unsupported parameter {_short(key)}: this server takes prompt (token ids), model, "
                             f"max_tokens, stream, stream_options and greedy settings only", key)
    body = {key: value for key, value in body.items() if value is not None}
    if "model" in body:
        if not isinstance(body["model"], str):
            raise BadRequest(f"model must be a string (the id GET /v1/models gives, {model!r}), got "
                             f"{_short(body['model'])}", "model")
        if body["model"] != model:
            raise BadRequest(f"the model {_short(body['model'])} does not exist: this server serves {model!r}",
                             "model", 404, "model_not_found")
    for key, (kind, what) in UNUSED.items():
        if key in body and (not isinstance(body[key], kind) or isinstance(body[key], bool)):
            raise BadRequest(f"{key} must be {what}, null or absent, got {_short(body[key])}", key)
    for key, allowed in NEUTRAL.items():
        if key in body and not _is_one_of(body[key], allowed):
            raise BadRequest(f"{key}={_short(body[key])} is not supported: {WHY_NOT[key]}", key)
    stream = _boolean(body, "stream")
    include_usage = False
    if body.get("stream_options") is not None:
        options = body["stream_options"]
        if not stream:
            raise BadRequest("stream_options applies to stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest(f"stream_options must be an object with at most include_usage, got {_short(options)}",
                             "stream_options")
        include_usage = _boolean(options, "include_usage", "stream_options.include_usage")
    max_tokens = _max_tokens(body)
    return Completion(parse_prompts(body, vocab_size, max_tokens, max_context), max_tokens, stream, include_usage)


def parse_prompts(body: dict, vocab_size: int, max_tokens: int = 0, max_context: int | None = None) -> list[list[int]]:
    """`prompt` as a list of at most MAX_PROMPTS prompts, each a non-empty list of ids in
    [0, vocab_size) that fits max_context with max_tokens (unless max_context is None)."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("missing prompt: expected a list of token ids, or a list of such lists", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise BadRequest("prompt must be token ids (a list of integers, or a list of such lists): checkpoints "
                         "here carry no tokenizer, so text prompts cannot be read", "prompt")
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest(f"prompt must be a non-empty list of token ids, or a list of such lists, got "
                         f"{_short(prompt)}", "prompt")
    prompts = prompt if isinstance(prompt[0], list) else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"prompt holds {len(prompts)} prompts: at most {MAX_PROMPTS} prompts a request (send "
                         f"the rest in other requests)", "prompt")
    for i, ids in enumerate(prompts):
        where = f"prompt {i}" if len(prompts) > 1 else "prompt"
        if not isinstance(ids, list) or not ids:
            raise BadRequest(f"{where} must be a non-empty list of token ids, got {_short(ids)}", "prompt")
        if max_context is not None and len(ids) + max_tokens > max_context:
            raise BadRequest(f"{where} cannot be served: a prompt of {len(ids)} tokens plus {max_tokens} new ones "
                             f"needs {len(ids) + max_tokens} tokens, over the server's max_context={max_context}",
                             "prompt")
        for j, token in enumerate(ids):
            if not _is_int(token):
                raise BadRequest(f"{where}: element {j} is {_short(token)}, expected an integer token id", "prompt")
            if not 0 <= token < vocab_size:
                raise BadRequest(f"{where}: token id {token} (element {j}) is outside the vocabulary: expected "
                                 f"0 <= id < {vocab_size}", "prompt")
    return prompts


def _max_tokens(body: dict) -> int:
    value = body.get("max_tokens")
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not _is_int(value) or value < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {_short(value)}", "max_tokens")
    return value


def _boolean(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name or key} must be true or false, got {_short(value)}", name or key)
    return value


def _short(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a bad field may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_one_of(value, allowed: tuple) -> bool:
    return any(_same_json(value, a) for a in allowed)


def _same_json(a, b) -> bool:
    """JSON equality: true is not 1, 0.0 is 0."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


# -- responses ---------------------------------------------------------------------------------

def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:24]}"


def choice(index: int, tokens: list[int], finish_reason: str | None) -> dict:
    return {"index": index, "text": " ".join(map(str, tokens)), "token_ids": list(tokens),
            "logprobs": None, "finish_reason": finish_reason}


def usage(prompts: list[list[int]], completions: list[list[int]]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(cid: str, model: str, choices: list[dict], counts: dict | None) -> dict:
    body = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if counts is not None:
        body["usage"] = counts
    return body


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
