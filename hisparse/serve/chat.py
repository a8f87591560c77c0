"""OpenAI's chat completions: `messages` through the tokenizer's chat template into one prompt
(`parse_chat`, the other fields as `protocol.parse_common` reads them), and the chat.completion
body and chat.completion.chunk stream (`Chat`). A checkpoint without a tokenizer, or whose tokenizer
has no chat template, answers a 400 that says so.
"""
from __future__ import annotations

from hisparse.sampling import MAX_LOGPROBS
from hisparse.serve.outputs import Choice, TokenOut
from hisparse.serve.protocol import (
    COMMON,
    NO_TOKENIZER,
    BadRequest,
    Completions,
    Generation,
    _is_int,
    boolean,
    check_fields,
    check_min_tokens,
    parse_common,
    short,
    token_count,
    token_text,
    usage,
)
from hisparse.text import Tokenizer, check_text

CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
MESSAGE_KEYS = {"role", "content", "name"}
ROLES = ("system", "developer", "user", "assistant")     # OpenAI's, less tool and function (no tool calls here)


def parse_chat(body, vocab_size: int, model: str, max_context: int, tokenizer: Tokenizer | None) -> Generation:
    """The checked chat request: its one prompt is the chat template's text of `messages`; max_tokens
    (or max_completion_tokens) defaults to what max_context leaves. BadRequest naming the first bad field."""
    body = check_fields(body, CHAT_FIELDS, "/v1/chat/completions", model)
    if tokenizer is None or tokenizer.chat_template is None:
        why = NO_TOKENIZER if tokenizer is None else f"the tokenizer in {tokenizer.folder} has no chat template"
        raise BadRequest(f"chat completions need a chat template: {why}; send prompts to POST /v1/completions",
                         "messages")
    messages = _messages(body)
    max_tokens = token_count(body, "max_completion_tokens", None)
    legacy = token_count(body, "max_tokens", None)           # checked even where max_completion_tokens wins
    max_tokens = max_tokens if max_tokens is not None else legacy
    logprobs = None
    if boolean(body, "logprobs"):
        logprobs = body.get("top_logprobs", 0)
        if not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {short(logprobs)}",
                             "top_logprobs")
    elif body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    generation = parse_common(body, vocab_size, tokenizer, logprobs, max_tokens or 1)
    try:
        _, ids = tokenizer.chat(messages)
    except ValueError as exc:
        raise BadRequest(str(exc), "messages") from None
    room = max_context - len(ids)
    if room < (max_tokens or 1):
        raise BadRequest(f"the messages cannot be served: their prompt of {len(ids)} tokens plus "
                         f"{max_tokens or 1} new ones is over the server's max_context={max_context}", "messages")
    generation.prompts, generation.max_tokens = [ids], max_tokens or room
    check_min_tokens(generation.sampling, generation.max_tokens,
                     "" if max_tokens else f" (what max_context={max_context} leaves after the prompt)")
    return generation


def _messages(body: dict) -> list[dict]:
    """`messages` as the chat template takes them: role, content as a string (text parts joined), name."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages must be a non-empty list of messages, got {short(messages)}", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where} must be an object with role and content, got {short(message)}", "messages")
        extra = sorted(k for k, v in message.items() if k not in MESSAGE_KEYS and v is not None)
        if extra:
            raise BadRequest(f"{where}.{extra[0]} is not supported: a message has role, content and name only",
                             "messages")
        if not isinstance(message.get("role"), str):
            raise BadRequest(f"{where}.role must be a string, got {short(message.get('role'))}", "messages")
        if message["role"] not in ROLES:
            raise BadRequest(f"{where}.role {short(message['role'])} is not one this server takes: "
                             f"{', '.join(ROLES)} (tool and function messages are not supported)", "messages")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise BadRequest(f"{where}.name must be a string, null or absent, got {short(message['name'])}",
                             "messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are read, "
                                 f"got {short(content)}", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string or a list of text parts, got {short(content)}",
                             "messages")
        for key, text in (("role", message["role"]), ("content", content), ("name", message.get("name") or "")):
            try:
                check_text(text)
            except ValueError as exc:
                raise BadRequest(f"{where}.{key}: {exc}", "messages") from None
        out.append({key: value for key, value in (("role", message["role"]), ("content", content),
                                                  ("name", message.get("name"))) if value is not None})
    return out


class Chat(Completions):
    """The /v1/chat/completions answer: a chat.completion body, or chat.completion.chunk events (a
    role chunk, then one a token)."""

    prefix, kind = "chatcmpl", "chat.completion"

    def envelope(self, choices: list[dict], counts: dict | None = None, chunk: bool = True) -> dict:
        body = super().envelope(choices, counts)
        body["object"] = "chat.completion.chunk" if chunk else "chat.completion"
        return body

    def body(self, choices: list[Choice]) -> dict:
        out = []
        for i, c in enumerate(choices):
            choice = {"index": i, "message": {"role": "assistant", "content": c.text},
                      "logprobs": self._logprobs(c.tokens, c.logprobs), "finish_reason": c.finish}
            if self.generation.return_token_ids:
                choice["token_ids"] = list(c.tokens)
            out.append(choice)
        counts = usage(self.generation.prompts, sum(len(c.tokens) for c in choices))
        return self.envelope(out, counts, chunk=False)

    def opening(self, index: int, choice: Choice) -> list[dict]:
        return [self.envelope([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}])]

    def chunk(self, index: int, choice: Choice, out) -> dict:
        is_token = isinstance(out, TokenOut)
        token = [out.token] if is_token else []
        logprobs = [out.logprob] if is_token and out.logprob is not None else []
        body = {"index": index, "delta": {"content": out.text}, "logprobs": self._logprobs(token, logprobs),
                "finish_reason": out.finish}
        if self.generation.return_token_ids:
            body["token_ids"] = token
        return self.envelope([body])

    def _logprobs(self, tokens: list[int], logprobs: list, choice: Choice | None = None) -> dict | None:
        """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        if self.generation.sampling.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            return {"token": token_text(self.tokenizer, token), "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token))}      # chat always has a tokenizer
        return {"content": [dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in top])
                            for t, (lp, top) in zip(tokens, logprobs)]}
