"""OpenAI's completions format: a request body checked field by field (a `BadRequest` names the
field and what was expected) into a `Generation`, and the response, chunk and error bodies. The
fields both endpoints take (sampling, stop, stream) are read here for chat too (`chat.py`).

With a tokenizer (`hisparse.text`) a prompt is a string, a list of strings, token ids or a list of
lists of ids, as vLLM and SGLang take them, and a choice's `text` is decoded (its ids with
`return_token_ids`). Without one, prompts are token ids and `text` is the ids joined by spaces, the
ids always given back. A null field is an absent one (what OpenAI's clients send for "not given").
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, replace

from hisparse.sampling import SamplingParams
from hisparse.serve.outputs import Choice, TokenOut
from hisparse.text import MAX_STOPS, Tokenizer

DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 256     # prompts a request may carry: 20,000 once held the server thread (and /metrics) for 36 s

# settings read into SamplingParams as they are (its `check` names a bad one)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "min_tokens",
            "ignore_eos")
COMMON = {"model", "max_tokens", "stream", "stream_options", "n", "stop", "stop_token_ids", "logit_bias", "user",
          "return_token_ids", *SAMPLING}
COMPLETION_FIELDS = COMMON | {"prompt", "best_of", "logprobs", "echo", "suffix"}
NO_TOKENIZER = "this checkpoint has no tokenizer (no tokenizer.json or tokenizer_config.json in its folder)"


class BadRequest(Exception):
    """A request the server refuses: HTTP `status`, the `param` at fault, the message, OpenAI's `code`."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass
class Generation:
    """A checked request (completions or chat): what each prompt's request is and how it is answered."""

    prompts: list[list[int]]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool              # stream_options.include_usage: a last chunk with the counts
    return_token_ids: bool = False   # token ids in the choices (always without a tokenizer)
    echo: list[str] | None = None    # completions' echo: each prompt's text, given back before its answer


def check_fields(body, known: set, endpoint: str, model: str) -> dict:
    """The body without its nulls, once it is an object of known fields naming this model (a 404
    model_not_found for another's name, as OpenAI's API answers)."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got a JSON {type(body).__name__}", None)
    for key in body:
        if key not in known and body[key] is not None:       # a null field is an absent one, known or not
            raise BadRequest(f"unsupported parameter {short(key)}: {endpoint} takes {', '.join(sorted(known))}", key)
    body = {key: value for key, value in body.items() if value is not None}
    if "model" in body:
        if not isinstance(body["model"], str):
            raise BadRequest(f"model must be a string (the id GET /v1/models gives, {model!r}), got "
                             f"{short(body['model'])}", "model")
        if body["model"] != model:
            raise BadRequest(f"the model {short(body['model'])} does not exist: this server serves {model!r}",
                             "model", 404, "model_not_found")
    if "user" in body and not isinstance(body["user"], str):
        raise BadRequest(f"user must be a string, null or absent, got {short(body['user'])}", "user")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise BadRequest(f"n={short(body['n'])} is not supported: one choice per prompt (n 1, null or absent); send "
                         f"the request again (another seed) for another", "n")
    return body


def parse_completion(body, vocab_size: int, model: str, max_context: int | None = None,
                     tokenizer: Tokenizer | None = None) -> Generation:
    """The checked request for the model named `model`; BadRequest naming the first bad field.
    max_context: a prompt that cannot fit it with max_tokens is refused before its ids are read."""
    body = check_fields(body, COMPLETION_FIELDS, "/v1/completions", model)
    if body.get("best_of", 1) != 1 or isinstance(body.get("best_of"), bool):
        raise BadRequest(f"best_of={short(body['best_of'])} is not supported: one choice per prompt (best_of 1, "
                         f"null or absent)", "best_of")
    if body.get("suffix", "") != "":
        raise BadRequest("suffix is not supported (no insertion): an empty string, null or absent", "suffix")
    max_tokens = token_count(body, "max_tokens", DEFAULT_MAX_TOKENS)
    echo = boolean(body, "echo")
    if echo and tokenizer is None:
        raise BadRequest(f"echo needs the prompt as text: {NO_TOKENIZER}", "echo")
    if echo and body.get("logprobs") is not None:
        raise BadRequest("echo with logprobs is not supported: the prompt's log-probabilities are not computed",
                         "logprobs")
    generation = parse_common(body, vocab_size, tokenizer, body.get("logprobs"), max_tokens)
    check_min_tokens(generation.sampling, max_tokens)
    prompts, texts = parse_prompts(body, vocab_size, max_tokens, max_context, tokenizer)
    generation.prompts = prompts
    if echo:
        generation.echo = [text if text is not None else tokenizer.decode(ids) for ids, text in zip(prompts, texts)]
    return generation


def parse_common(body: dict, vocab_size: int, tokenizer: Tokenizer | None, logprobs, max_tokens: int) -> Generation:
    """The fields both endpoints take: stream, stream_options, return_token_ids, stop and the
    sampling settings (SamplingParams.check's ValueError becomes a 400 naming its field)."""
    stream = boolean(body, "stream")
    include_usage = False
    if body.get("stream_options") is not None:
        options = body["stream_options"]
        if not stream:
            raise BadRequest("stream_options applies to stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest(f"stream_options must be an object with at most include_usage, got {short(options)}",
                             "stream_options")
        include_usage = boolean(options, "include_usage", "stream_options.include_usage")
    stop = _stop(body, tokenizer)
    settings = {key: body[key] for key in SAMPLING if key in body}
    if settings.get("top_k") == -1:
        settings["top_k"] = 0                      # vLLM's "every token"
    if "stop_token_ids" in body:
        if not isinstance(body["stop_token_ids"], list):
            raise BadRequest(f"stop_token_ids must be a list of token ids, got {short(body['stop_token_ids'])}",
                             "stop_token_ids")
        settings["stop_token_ids"] = tuple(body["stop_token_ids"])
    if "logit_bias" in body:
        settings["logit_bias"] = _logit_bias(body["logit_bias"])
    try:
        sampling = SamplingParams(**settings, logprobs=logprobs).check(vocab_size)
    except ValueError as exc:
        field = re.match(r"[a-z_]+", str(exc))
        raise BadRequest(str(exc), field.group(0) if field else None) from None
    if len(sampling.stop_token_ids) > len(sampling.stop_ids):     # checked ids: kept once each, in their order
        sampling = replace(sampling, stop_token_ids=tuple(dict.fromkeys(sampling.stop_token_ids)))
    return Generation([], max_tokens, sampling, stop, stream, include_usage,
                      tokenizer is None or boolean(body, "return_token_ids"))


def check_min_tokens(sampling: SamplingParams, max_tokens: int, why: str = "") -> None:
    """BadRequest unless min_tokens <= max_tokens (a request ends at max_tokens: more never comes)."""
    if sampling.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens={sampling.min_tokens} is over max_tokens={max_tokens}{why}: a request ends at "
                         f"max_tokens, so min_tokens must be at most that", "min_tokens")


def parse_prompts(body: dict, vocab_size: int, max_tokens: int = 0, max_context: int | None = None,
                  tokenizer: Tokenizer | None = None) -> tuple[list[list[int]], list[str | None]]:
    """`prompt` as at most MAX_PROMPTS prompts of ids in [0, vocab_size) that each fit max_context
    with max_tokens (unless max_context is None), and the text of each given as text (else None)."""
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("missing prompt: expected a string, a list of strings, a list of token ids, or a list of "
                         "such lists" if tokenizer else "missing prompt: expected a list of token ids, or a list of "
                         "such lists", "prompt")
    prompt = body["prompt"]
    texts = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str))
    if texts and tokenizer is None:
        raise BadRequest(f"prompt must be token ids (a list of integers, or a list of such lists): {NO_TOKENIZER}, "
                         f"so text prompts cannot be read", "prompt")
    if not isinstance(prompt, (list, str)) or not prompt:
        raise BadRequest(f"prompt must be a non-empty string or list (of token ids, strings or lists of ids), got "
                         f"{short(prompt)}", "prompt")
    prompts = [prompt] if isinstance(prompt, str) or not isinstance(prompt[0], (list, str)) else prompt
    if len(prompts) > MAX_PROMPTS:
        raise BadRequest(f"prompt holds {len(prompts)} prompts: at most {MAX_PROMPTS} prompts a request (send "
                         f"the rest in other requests)", "prompt")
    out, given = [], []
    for i, item in enumerate(prompts):
        where = f"prompt {i}" if len(prompts) > 1 else "prompt"
        if texts:
            if not isinstance(item, str):
                raise BadRequest(f"{where} is {short(item)}: a list of strings holds strings only", "prompt")
            try:
                ids = tokenizer.encode(item)
            except ValueError as exc:
                raise BadRequest(f"{where}: {exc}", "prompt") from None
            if not ids:
                raise BadRequest(f"{where} is empty: its text gives no tokens", "prompt")
        else:
            ids = item
            if not isinstance(ids, list) or not ids:
                raise BadRequest(f"{where} must be a non-empty list of token ids, got {short(ids)}", "prompt")
        if max_context is not None and len(ids) + max_tokens > max_context:
            raise BadRequest(f"{where} cannot be served: a prompt of {len(ids)} tokens plus {max_tokens} new ones "
                             f"needs {len(ids) + max_tokens} tokens, over the server's max_context={max_context}",
                             "prompt")
        if not texts:
            _check_ids(ids, where, vocab_size)
        out.append(ids)
        given.append(item if texts else None)
    return out, given


def _check_ids(ids: list, where: str, vocab_size: int) -> None:
    for j, token in enumerate(ids):
        if not _is_int(token):
            raise BadRequest(f"{where}: element {j} is {short(token)}, expected an integer token id", "prompt")
        if not 0 <= token < vocab_size:
            raise BadRequest(f"{where}: token id {token} (element {j}) is outside the vocabulary: expected "
                             f"0 <= id < {vocab_size}", "prompt")


def _stop(body: dict, tokenizer: Tokenizer | None) -> tuple[str, ...]:
    stop = body.get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest(f"stop must be a string or a list of strings, got {short(stop)}", "stop")
    stops = [s for s in stops if s != ""] if isinstance(stop, str) else stops
    if len(stops) > MAX_STOPS or "" in stops:
        raise BadRequest(f"stop holds {len(stops)} strings{' (an empty one)' if '' in stops else ''}: expected at "
                         f"most {MAX_STOPS} non-empty strings", "stop")
    if stops and tokenizer is None:
        raise BadRequest(f"stop strings are matched on the answer's text: {NO_TOKENIZER}; stop_token_ids stops at "
                         f"token ids", "stop")
    return tuple(stops)


def _logit_bias(value) -> dict[int, float]:
    if not isinstance(value, dict):
        raise BadRequest(f"logit_bias must be an object of token id (a string) to a bias, got {short(value)}",
                         "logit_bias")
    out = {}
    for key, bias in value.items():
        if not re.fullmatch(r"[0-9]{1,18}", key):           # \d takes other scripts' digits too
            raise BadRequest(f"logit_bias: key {short(key)} is not a token id (digits)", "logit_bias")
        out[int(key)] = bias
    return out


def token_count(body: dict, key: str, default: int | None) -> int | None:
    """body[key], a number of tokens >= 1, or `default` where it is absent."""
    value = body.get(key)
    if value is None:
        return default
    if not _is_int(value) or value < 1:
        raise BadRequest(f"{key} must be an integer >= 1, got {short(value)}", key)
    return value


def boolean(body: dict, key: str, name: str | None = None) -> bool:
    """body[key], true or false (false where absent); `name` is the field's name in the 400."""
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name or key} must be true or false, got {short(value)}", name or key)
    return value


def short(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (a bad field may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- responses ---------------------------------------------------------------------------------

def completion_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompts: list[list[int]], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_text(tokenizer: Tokenizer | None, token: int) -> str:
    return str(token) if tokenizer is None else tokenizer.token_text(token)


class Completions:
    """The /v1/completions answer: a text_completion body, or its chunks (one a token)."""

    prefix, kind = "cmpl", "text_completion"

    def __init__(self, generation: Generation, tokenizer: Tokenizer | None, model: str):
        self.generation, self.tokenizer, self.model = generation, tokenizer, model
        self.id = completion_id(self.prefix)
        self.created = int(time.time())

    def envelope(self, choices: list[dict], counts: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "choices": choices}
        if counts is not None:
            body["usage"] = counts
        return body

    def choices(self) -> list[Choice]:
        echo = self.generation.echo
        return [Choice(prefix=echo[i] if echo else "") for i in range(len(self.generation.prompts))]

    def body(self, choices: list[Choice]) -> dict:
        out = []
        for i, c in enumerate(choices):
            text = c.prefix + c.text if self.tokenizer is not None else " ".join(map(str, c.tokens))
            out.append(self._choice(i, text, c.tokens, c.logprobs, c, c.finish))
        return self.envelope(out, usage(self.generation.prompts, sum(len(c.tokens) for c in choices)))

    def opening(self, index: int, choice: Choice) -> list[dict]:
        """The chunks a prompt's stream starts with: its echoed text."""
        return [self.envelope([self._choice(index, choice.prefix, [], [], choice, None)])] if choice.prefix else []

    def chunk(self, index: int, choice: Choice, out) -> dict:
        """The chunk of one TokenOut (or of an End's last text and finish), before `choice` takes it."""
        token = [out.token] if isinstance(out, TokenOut) else []
        logprobs = [out.logprob] if isinstance(out, TokenOut) and out.logprob is not None else []
        text = out.text if self.tokenizer is not None else "".join(map(str, token))
        return self.envelope([self._choice(index, text, token, logprobs, choice, out.finish)])

    def usage_chunk(self, completion_tokens: int) -> dict:
        return self.envelope([], usage(self.generation.prompts, completion_tokens))

    def _choice(self, index: int, text: str, tokens: list[int], logprobs: list, choice: Choice, finish) -> dict:
        body = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if self.generation.sampling.logprobs is not None:
            body["logprobs"] = self._logprobs(tokens[:len(logprobs)], logprobs, choice)
        if self.generation.return_token_ids:
            body["token_ids"] = list(tokens)
        return body

    def _logprobs(self, tokens: list[int], logprobs: list, choice: Choice) -> dict:
        """OpenAI's completions logprobs of these tokens, their text_offset counted on from `choice.offset`."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, (logprob, top) in zip(tokens, logprobs):
            text = token_text(self.tokenizer, token)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append({token_text(self.tokenizer, t): lp for t, lp in top})
            out["text_offset"].append(choice.offset)
            choice.offset += len(text)
        return out


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
