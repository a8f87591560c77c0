"""One HTTP request's answers as they come out of the server thread: `Sink` turns each new token of
each prompt into a `TokenOut` (its id, the text a client may be sent now, its log-probabilities, and
on the prompt's last token why it finished) and hands it to the event loop; `Choice` gathers one
prompt's. The text work (incremental detokenisation, stop strings: `hisparse.text.TextStream`) runs
on the server thread, inside `on_token`, so a stop string ends its request at once and frees its lane.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hisparse.text import TextStream


@dataclass
class TokenOut:
    token: int
    text: str                      # what may be sent now ("" while it may be the start of a stop string)
    logprob: tuple | None          # (its log-probability, [(id, log-probability)] the top N), if asked for
    finish: str | None = None      # on the prompt's last token: "stop" or "length"


@dataclass
class End:
    """A prompt is over: error None (finished; `text`, `finish` if its last token did not carry them)
    or why it stopped (cancelled, shut down, the step failed)."""

    error: str | None
    text: str = ""
    finish: str | None = None


class Sink:
    """One HTTP request's prompts, from the server thread into an asyncio queue of (index, TokenOut | End).
    streams[i]: prompt i's TextStream (None without a tokenizer: ids only)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, streams: list[TextStream | None]):
        self.loop, self.queue, self.streams = loop, asyncio.Queue(), streams
        self.finished = [False] * len(streams)      # the prompt's last TokenOut said why it finished

    def token(self, index: int, request, token: int) -> None:
        """On the server thread, as the token comes out: a stop string sets request.finish_reason ("stop")."""
        stream, count = self.streams[index], len(request.tokens)
        text = ""
        if stream is not None and request.finish_reason != "stop":     # a stop id's text is not the answer's
            text, stopped = stream.add(token, count)
            if stopped:
                request.finish_reason = "stop"
        finish = None
        if request.done:
            finish = self._finish(index, request)
            text += self._rest(index, request)
        logprobs = request.token_logprobs
        logprob = logprobs[count - 1] if request.sampling.logprobs is not None and len(logprobs) >= count else None
        self._put((index, TokenOut(token, text, logprob, finish)))

    def end(self, index: int, request, error: str | None) -> None:
        """On the server thread, once per prompt: finished (error None) or stopped (why)."""
        if error is not None or self.finished[index]:
            self._put((index, End(error)))
            return
        text = self._rest(index, request)           # it finished after its last token's call (the sampler's stop)
        self._put((index, End(None, text, self._finish(index, request))))

    def _finish(self, index: int, request) -> str:
        self.finished[index] = True
        return request.finish_reason or "length"

    def _rest(self, index: int, request) -> str:
        """The text held back till the end (a stop string may complete in it)."""
        stream = self.streams[index]
        if stream is None:
            return ""
        text, stopped = stream.finish(len(request.tokens))
        if stopped:
            request.finish_reason = "stop"
        return text

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:          # the loop has closed: nobody is listening any more
            pass


@dataclass
class Choice:
    """One prompt's answer so far: its text, ids, log-probabilities (with each token's text and its
    offset in the text, as OpenAI's completions give them), and why it finished."""

    prefix: str = ""                               # the echoed prompt's text, before the answer's
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)     # (logprob, top) per token, when asked for
    finish: str | None = None
    offset: int = 0                                # where the next token's text starts (token_text lengths)

    def __post_init__(self):
        self.offset = len(self.prefix)

    def add(self, out: TokenOut | End) -> None:
        self.text += out.text
        if isinstance(out, TokenOut):
            self.tokens.append(out.token)
            if out.logprob is not None:
                self.logprobs.append(out.logprob)
        self.finish = out.finish or self.finish
