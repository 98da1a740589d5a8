"""HTTP/1.1 for agentenv's own services: agentenv's routes on aiohttp's web server.

The Buffer service (``agentenv buffer serve``) and the embedded engine's SGLang-compatible
server speak HTTP through this module. Handlers see agentenv's own small API, whatever
serves them; aiohttp (``aiohttp.web.Server``) parses requests and writes answers. The
server (:class:`HTTPServer`) has:

- keep-alive connections (HTTP/1.1, and HTTP/1.0 with ``Connection: keep-alive``);
  HTTP/1.1 requests must carry ``Host`` (RFC 9112), as aiohttp requires;
- request bodies with ``Content-Length`` only: a chunked (or any ``Transfer-Encoding``)
  request body is refused with 411, a malformed request with 400, an oversized head with
  431 and an oversized body with 413 -- the connection is then closed, the server is not;
- JSON and binary responses (:class:`Response`) and streamed ones
  (:class:`StreamingResponse`: chunked transfer, e.g. server-sent events via :func:`sse`);
- a :class:`Router` from ``(method, path)`` to ``async def handler(request) -> response``;
  handlers raise :class:`HTTPError` for an error status with a JSON body
  ``{"error": {"type": ..., "message": ...}}`` (errors of the request's form too);
- long-poll routes (``long_poll=True``): the handler is cancelled when the client
  disconnects or the server shuts down, so a waiting handler never hands its result to
  nobody (see :attr:`Response.on_undelivered`);
- a ``guard`` that sees each request's head before its body is read (authentication;
  :func:`api_key_guard` is SGLang's ``--api-key`` check);
- a connection cap (``max_connections``, below the descriptor limit by default): at the
  cap the longest-idle connection makes room, when all are busy a reserve answers probe
  routes (``probe=True``, health checks) and the rest get 503 (see ``_limits.py``);
- timeouts: idle connections close after ``keepalive_timeout``, a request head must
  arrive within ``head_timeout`` of its first byte and a body within
  ``request_timeout`` (408);
- a per-client limit (``client_limit``, :class:`ClientLimit`): requests of one client in
  flight at once, counted from the head (429 beyond, unread), so one client sending
  heads and half bodies cannot take every connection;
- JSON bodies (``Request.json``, :func:`decode_json`) nested at most
  :data:`MAX_JSON_DEPTH` deep (400 beyond, never a RecursionError);
- graceful shutdown: leaving ``async with HTTPServer(...)`` stops accepting, closes idle
  connections, lets in-flight requests finish for ``shutdown_grace`` seconds, then cancels.

It binds to 127.0.0.1 unless told otherwise; it imports aiohttp on first use. The
services' clients are aiohttp's: ``SGLangClient`` directly, and those written against
httpx (``BufferClient``, the endpoint's OpenAI and Anthropic clients) through
:class:`AiohttpTransport`, httpx's API over aiohttp's connection pool. ::

    router = Router()

    @router.route("GET", "/health")
    async def health(request: Request) -> Response:
        return Response.json({"ok": True})

    async with HTTPServer(router) as server:
        print(server.url)
        await anyio.sleep_forever()
"""

from typing import TYPE_CHECKING, Any

from agentenv._http._api import (
    MAX_JSON_DEPTH,
    ErrorShape,
    Guard,
    Handler,
    HTTPError,
    Request,
    Response,
    Router,
    StreamingResponse,
    decode_json,
    sse,
)
from agentenv._http._auth import api_key_guard, check_api_key, warn_if_open
from agentenv._http._limits import MAX_BODY_BYTES, ClientLimit, raise_open_file_limit
from agentenv._http._transport import AiohttpTransport

if TYPE_CHECKING:
    from agentenv._http._server import HTTPServer

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "AiohttpTransport",
    "ClientLimit",
    "ErrorShape",
    "Guard",
    "HTTPError",
    "HTTPServer",
    "Handler",
    "Request",
    "Response",
    "Router",
    "StreamingResponse",
    "api_key_guard",
    "check_api_key",
    "decode_json",
    "raise_open_file_limit",
    "sse",
    "warn_if_open",
]


def __getattr__(name: str) -> Any:
    # The server loads aiohttp (~0.1 s) on first use: clients never pay for it.
    if name == "HTTPServer":
        from agentenv._http._server import HTTPServer

        return HTTPServer
    raise AttributeError(f"module 'agentenv._http' has no attribute {name!r}")
