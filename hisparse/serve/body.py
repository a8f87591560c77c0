"""A request body as the server reads it, its Content-Encoding undone here: aiohttp's own decoding
is off (`AUTO_DECOMPRESS`) because it answers a coding it lacks (br, zstd without their packages)
with a plain-text 400 before any handler runs; here every refusal is OpenAI's JSON error.

Codings: gzip (x-gzip), deflate (zlib's format, or raw deflate as some clients send it), identity,
applied in the header's order and undone in reverse; any other is a 415 naming it, with
`Accept-Encoding` saying which are read (RFC 9110, 15.5.16). The decoded body is capped at
`MAX_BODY_BYTES`, as the raw one is, so a small bomb is a 413, not a full memory.
"""
from __future__ import annotations

import zlib

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from hisparse.serve.protocol import BadRequest

MAX_BODY_BYTES = 64 * 2 ** 20     # a 128K-token prompt is under 1 MiB of JSON; aiohttp's default is 1 MiB
AUTO_DECOMPRESS = False           # aiohttp's runner keyword: the handler decodes (`read_body`)
READ_CODINGS = ("gzip", "deflate", "identity")


class UnreadableBody(BadRequest):
    """A body that cannot be read off the connection: answered, then the connection closed."""


class UnsupportedEncoding(BadRequest):
    """A Content-Encoding this server does not read: 415, with the codings it does."""

    headers = {"Accept-Encoding": ", ".join(READ_CODINGS)}


async def read_body(request: web.Request) -> bytes:
    """The body's bytes with its Content-Encoding undone; BadRequest (or a subclass) if it cannot be."""
    header = request.headers.get("Content-Encoding", "")
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    unknown = [c for c in codings if c not in READ_CODINGS and c != "x-gzip"]
    if unknown:                                  # refused before the body is read
        raise UnsupportedEncoding(f"the request body's Content-Encoding {unknown[0]!r} is not one this server reads: "
                                  f"send it as {', '.join(READ_CODINGS)} (or without the header)", None, 415)
    try:
        raw = await request.read()
    except RequestPayloadError as exc:           # e.g. a chunked body cut short
        request.content.feed_eof()               # what is left is unreadable: aiohttp then does not read it again
        raise UnreadableBody(f"the request body cannot be read: {str(exc).splitlines()[-1].strip()}", None) from None
    for coding in reversed(codings):
        if coding != "identity":
            raw = _decode(raw, coding, header)
    return raw


def _decode(raw: bytes, coding: str, header: str) -> bytes:
    if coding == "deflate":                      # zlib's header has compression method 8 in its low nibble
        wbits = zlib.MAX_WBITS if raw[:1] and raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        wbits = 16 + zlib.MAX_WBITS              # gzip's header and trailer
    decoder = zlib.decompressobj(wbits)
    try:
        out = decoder.decompress(raw, MAX_BODY_BYTES + 1)
    except zlib.error as exc:
        raise BadRequest(f"the request body cannot be read as its Content-Encoding header ({header!r}) says: "
                         f"not {coding} data ({exc})", None) from None
    if len(out) > MAX_BODY_BYTES:
        raise BadRequest(f"the request body, decoded from {coding}, is over the {MAX_BODY_BYTES // 2 ** 20} MiB this "
                         f"server reads", None, 413)
    if not decoder.eof or decoder.unused_data:
        raise BadRequest(f"the request body cannot be read as its Content-Encoding header ({header!r}) says: "
                         f"{'truncated' if not decoder.eof else 'bytes after the end of'} {coding} data", None)
    return out
