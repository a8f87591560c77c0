"""The aiohttp application: OpenAI-style completions and chat completions over a `ServerThread`,
health, model info and Prometheus metrics (prometheus_client, the server thread's registry:
`metrics.py`), and the graceful shutdown (see the package docstring).

Handlers run on the event loop; the server thread reaches them only through `outputs.Sink`, which
turns each token into text there and moves it onto the loop with `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import traceback
from dataclasses import dataclass, field

import torch
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from hisparse.serve.body import AUTO_DECOMPRESS, MAX_BODY_BYTES, UnreadableBody, read_body
from hisparse.serve.chat import Chat, parse_chat
from hisparse.serve.metrics import CONTENT_TYPE_LATEST
from hisparse.serve.outputs import End, Sink
from hisparse.serve.protocol import BadRequest, Completions, error_body, parse_completion
from hisparse.serve.worker import PromptRefused, ServerStopped, ServerThread
from hisparse.serving import Server
from hisparse.text import TextStream, Tokenizer

ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics"
ACCESS_LOG = logging.getLogger("hisparse.serve.access")


@dataclass
class Service:
    """What the handlers share: the server thread, the model's description, its tokenizer (None:
    prompts are token ids), whether it is draining."""

    worker: ServerThread
    info: dict
    tokenizer: Tokenizer | None = None
    draining: bool = False
    pending: set = field(default_factory=set)        # completion handlers running now

    @property
    def name(self) -> str:
        return self.info["id"]

    @property
    def vocab_size(self) -> int:
        return self.info["hisparse"]["vocab_size"]


SERVICE = web.AppKey("service", Service)
TOKENS = web.RequestKey("tokens", tuple)   # a completion's (prompt, completion) token counts, for its access line


class AccessLog(AbstractAccessLogger):
    """One line per request at INFO: client, method, path, status, tokens in + out ("-" where none
    were served), seconds until the answer's last byte."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        tokens = request.get(TOKENS)
        counted = "-" if tokens is None else f"{tokens[0]}+{tokens[1]} tokens"
        self.logger.info("%s %s %s %d %s %.3f s", request.remote, request.method, request.path, response.status,
                         counted, time)

    @property
    def enabled(self) -> bool:
        return self.logger.isEnabledFor(logging.INFO)


def describe(server: Server, name: str, kv_budget_gib: float | None, host_budget_gib: float | None,
             workload: str = "model", tokenizer: Tokenizer | None = None) -> dict:
    """The model and how it is served (GET /v1/models): what a load client stamps on its rows.
    workload: the synthetic preset the requests replay, or "model" (the model's own selections);
    tokenizer: the one prompts are read with (its folder, and whether it has a chat template)."""
    cfg, runtime = server.model.config, server.runtime
    elem = server.model.model.embed_tokens.weight.element_size()
    if runtime.family == "DSA":
        unit_bytes = runtime.row_bytes                      # 576 values in the model's dtype, or the fp8 row
        q = torch.empty(1, cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                        dtype=server.model.model.embed_tokens.weight.dtype, device=server.device)
        from hisparse.dsa.fp8 import stored_decode_kernel
        kernel = stored_decode_kernel(q, cfg.kv_lora_rank, server.kv_dtype, server.decode_backend)
    else:
        unit_bytes, kernel = 2 * runtime.unit_size * cfg.head_dim * elem, "triton"
    hierarchical = server.mode != "resident"
    settings = {"family": runtime.family.lower(), "model_type": cfg.model_type, "mode": server.mode,
                "cache_slots": server.cache_slots if hierarchical else None, "k": runtime.selection_size,
                "unit_bytes": unit_bytes, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                "vocab_size": cfg.vocab_size, "max_context": server.max_context, "lanes": server.lanes,
                "kv_budget_gib": kv_budget_gib, "host_budget_gib": host_budget_gib if hierarchical else None,
                "prefill_chunk": server.prefill_chunk, "graph": server.graph, "decode_backend": server.decode_backend,
                "attention_kernel": kernel, "workload": workload, "device": str(server.device),
                "tokenizer": None if tokenizer is None else tokenizer.folder,
                "chat": tokenizer is not None and tokenizer.chat_template is not None}
    if runtime.family == "DSA":
        settings["kv_dtype"] = server.kv_dtype
        settings["index_dtype"] = runtime.index_dtype
        settings["prefix_cache"] = server.sharing is not None
        settings["prefill_overlap"] = server.prefill_overlap
        settings["prefill_layers"] = server.prefill_layers if server.prefill_overlap else None
        settings["prefill_sms"] = server.prefill_sms
    if runtime.family == "Quest":
        settings["token_budget"] = runtime.selection_size * runtime.unit_size
    return {"id": name, "object": "model", "owned_by": "hisparse", "max_model_len": server.max_context,
            "hisparse": settings}


def make_app(service: Service) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
    app[SERVICE] = service
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


# -- handlers ----------------------------------------------------------------------------------

def _error(status: int, message: str, param: str | None, kind: str = "invalid_request_error",
           code: str | None = None) -> web.Response:
    return web.json_response(error_body(message, param, kind, code), status=status)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (an unknown path, a method a route does not take, a body over the size
    limit) in OpenAI's error shape, as every other answer; a bug's a JSON 500 (and a traceback)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        where = f"{request.method} {request.path}"
        if exc.status == 404:
            message = f"Invalid URL ({where}): this server answers {ROUTES}"
        elif exc.status == 405:
            allowed = sorted(exc.allowed_methods - {"HEAD"}) or sorted(exc.allowed_methods)
            message = f"method {request.method} is not allowed on {request.path}: use {' or '.join(allowed)}"
        elif exc.status == 413:
            message = f"the request body is over the {MAX_BODY_BYTES // 2 ** 20} MiB this server reads"
        else:
            message = f"{exc.reason} ({where})"
        response = _error(exc.status, message, None)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception as exc:  # noqa: BLE001 - a bug: the client still gets JSON, the log the traceback
        traceback.print_exc()
        return _error(500, f"the server failed on this request: {exc!r}", None, "server_error")


async def health(request: web.Request) -> web.Response:
    if request.app[SERVICE].draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [request.app[SERVICE].info]})


async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    try:
        snapshot = await asyncio.wrap_future(service.worker.snapshot())
    except ServerStopped as exc:        # between the start of a shutdown and its final snapshot
        return _error(503, str(exc), None, "server_unavailable")
    body = service.worker.metrics.exposition(snapshot, service.draining)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    service = request.app[SERVICE]
    if service.draining:
        return _error(503, "the server is shutting down and takes no new requests", None, "server_unavailable")
    loop = asyncio.get_running_loop()
    try:
        raw = await read_body(request)
        # in a worker thread: the Python-level checks (and the tokenizer) of a big body would hold the loop
        generation = await loop.run_in_executor(None, _parse, raw, service, chat)
    except BadRequest as exc:
        service.worker.metrics.refused.inc()
        response = _error(exc.status, exc.message, exc.param, code=exc.code)
        response.headers.update(getattr(exc, "headers", {}))     # a 415's Accept-Encoding
        if isinstance(exc, UnreadableBody):
            response.force_close()             # the connection's next bytes cannot be trusted to start a request
        return response
    answer = (Chat if chat else Completions)(generation, service.tokenizer, service.name)
    tokenizer = service.tokenizer
    sink = Sink(loop, [None if tokenizer is None else
                       TextStream(tokenizer, ids, generation.stop, generation.sampling.min_tokens)
                       for ids in generation.prompts])
    try:
        submitted = service.worker.submit(generation.prompts, generation.max_tokens, sink, generation.sampling)
    except ServerStopped as exc:
        return _error(503, str(exc), None, "server_unavailable")
    try:
        requests = await asyncio.wrap_future(submitted)
    except PromptRefused as exc:
        service.worker.metrics.refused.inc()
        where = f"prompt {exc.index}" if len(generation.prompts) > 1 else "the prompt"
        return _error(400, f"{where} cannot be served: {exc}", exc.param)
    except ServerStopped as exc:
        return _error(503, str(exc), None, "server_unavailable")
    except asyncio.CancelledError:           # the client left while it was being queued
        submitted.add_done_callback(lambda f: _cancel_quietly(service, f))
        raise
    progress = _Progress(len(requests))
    task = asyncio.current_task()
    service.pending.add(task)
    try:
        if generation.stream:
            return await _stream(request, answer, sink, progress)
        return await _collect(answer, sink, progress)
    finally:
        request[TOKENS] = (sum(map(len, generation.prompts)), progress.tokens)
        service.pending.discard(task)
        if progress.ended < len(requests):   # the client went away (or a write failed): free its memory
            try:
                service.worker.cancel(requests)
            except ServerStopped:
                pass                          # shutdown cancels it anyway


@dataclass
class _Progress:
    prompts: int
    ended: int = 0
    error: str | None = None
    tokens: int = 0              # received so far, every prompt's


def _parse(raw: bytes, service: Service, chat: bool):
    """The checked request (`parse_completion`, `parse_chat`) of a raw body; BadRequest if it is not one."""
    example = '{"messages": [{"role": "user", "content": "Hi"}]}' if chat else '{"prompt": [1, 2, 3], "max_tokens": 16}'
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the request body is nested too deeply to read (Python's limit: about "
                         f"{sys.getrecursionlimit()} levels): expected an object such as {example}", None) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc}): expected an object such as {example}",
                         None) from None
    try:
        if chat:
            return parse_chat(body, service.vocab_size, service.name, service.info["max_model_len"], service.tokenizer)
        return parse_completion(body, service.vocab_size, service.name, service.info["max_model_len"],
                                service.tokenizer)
    except RecursionError:                       # a repr of a field nested near the limit
        raise BadRequest("a field of the request body is nested too deeply to read", None) from None


def _cancel_quietly(service: Service, submitted) -> None:
    if submitted.cancelled() or submitted.exception() is not None:
        return
    try:
        service.worker.cancel(submitted.result())
    except ServerStopped:
        pass


async def _next(sink: Sink, progress: _Progress):
    """The next (index, TokenOut | End) of a prompt (an End's error kept in `progress`)."""
    index, item = await sink.queue.get()
    if isinstance(item, End):
        progress.ended += 1
        progress.error = progress.error or item.error
    else:
        progress.tokens += 1
    return index, item


async def _collect(answer: Completions, sink: Sink, progress: _Progress) -> web.Response:
    choices = answer.choices()
    while progress.ended < progress.prompts:
        index, out = await _next(sink, progress)
        choices[index].add(out)
    if progress.error is not None:
        return _error(503, progress.error, None, "server_error")
    return web.json_response(answer.body(choices))


async def _stream(request: web.Request, answer: Completions, sink: Sink, progress: _Progress) -> web.StreamResponse:
    """Server-sent events: each prompt's opening chunks (chat's role, completions' echo), one chunk
    per token (a prompt's last says its finish_reason, or a chunk after it with the text held back
    till the end), the usage if asked for, then [DONE]; if the server stopped it, an error chunk and
    no [DONE]. A client gone away ends it quietly."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    choices = answer.choices()
    try:
        for index, choice in enumerate(choices):
            for chunk in answer.opening(index, choice):
                await _event(response, chunk)
        while progress.ended < progress.prompts:
            index, out = await _next(sink, progress)
            if isinstance(out, End) and out.error is not None:
                await _event(response, error_body(out.error, None, "server_error"))
                return response
            if not isinstance(out, End) or out.text or out.finish:
                await _event(response, answer.chunk(index, choices[index], out))
            choices[index].add(out)
        if answer.generation.include_usage:
            await _event(response, answer.usage_chunk(progress.tokens))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:         # aiohttp's ClientConnectionResetError: the client went away
        pass
    return response


async def _event(response: web.StreamResponse, body: dict) -> None:
    await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")


# -- running and stopping ----------------------------------------------------------------------

async def drain(service: Service, timeout: float) -> dict:
    """Stop taking requests (503), let those in flight finish for up to `timeout` s, cancel the rest,
    close the server: its final snapshot (every stream and host row free)."""
    service.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while service.worker.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    final = await loop.run_in_executor(None, service.worker.stop)
    if service.pending:                  # the handlers write their last events (an error for the cancelled)
        await asyncio.wait(set(service.pending), timeout=5)
    return final


async def serve(service: Service, host: str, port: int, stop: asyncio.Event, timeout: float,
                on_ready=None) -> dict:
    """Serve HTTP on host:port until `stop` is set, then drain (see `drain`): the final snapshot.
    on_ready(port) once listening (port 0 picks a free one)."""
    runner = web.AppRunner(make_app(service), handler_cancellation=True, access_log=ACCESS_LOG,
                           access_log_class=AccessLog, auto_decompress=AUTO_DECOMPRESS)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        if on_ready is not None:
            on_ready(bound)
        await stop.wait()
        return await drain(service, timeout)
    finally:
        await runner.cleanup()


def closing_line(final: dict) -> str:
    return (f"hisparse.serve: shut down: {final['served']} requests served, {final['cancelled']} cancelled, "
            f"{final['failed']} stopped; requests in flight {final['in_flight']}, host rows in use "
            f"{final['host_rows_in_use']} of {final['host_rows_capacity']}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
