"""An OpenAI-compatible HTTP front end over the serving engine (`hisparse.serving.Server`).

    python -m hisparse.serve --model DIR [--mode hisparse --cache-slots B] [--port 8000]
    python -m hisparse.serve.bench --url http://127.0.0.1:8000 --concurrency 8 --input-len 1024 --output-len 64

Threads. The model is not thread-safe, so one thread (`worker.ServerThread`) owns the
Server: it submits, steps, cancels and reads its sizes; aiohttp's handlers (`app`) run on the
event loop and reach it only through a command queue (futures back) and per-request sinks that
hand tokens to the loop with `call_soon_threadsafe`. A step runs whenever anything is in flight,
so a new request waits at most one iteration to be admitted.

Files: `protocol.py` (the completions format: request checks, response bodies; the fields chat shares),
`chat.py` (chat completions: messages through the chat template, chat bodies and chunks),
`outputs.py` (a request's tokens into text on the server thread, `hisparse.text`), `worker.py`
(the thread), `metrics.py` (GET /metrics: prometheus_client, a registry per server thread), `app.py`
(handlers, JSON errors, the access log, shutdown), `body.py` (a request body's Content-Encoding undone),
`prefill.py` (--disaggregated: the prefill worker processes the thread hands prompts to), `sizes.py`
(what the options allocate against what the machine has, before the server is built), `__main__.py` (the command), `bench.py` (the
load client: closed and open loops over HTTP and bench_serving's random dataset, rows under --out).
"""
