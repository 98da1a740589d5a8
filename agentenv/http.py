"""The HTTP/1.1 layer agentenv's own services are built on (the Buffer service,
``agentenv serve``, the per-episode endpoint), for a service of one's own built the same
way, and for measuring it (``agentenv bench http``, ``agentenv bench agent``).

A :class:`Router` maps ``(method, path)`` to ``async def handler(request) -> response``
(:class:`Request` in; :class:`Response` or :class:`StreamingResponse` out; raise
:class:`HTTPError` for an error status with a JSON body
``{"error": {"type": ..., "message": ...}}``, errors of the request's form too).
:class:`HTTPServer` serves it on aiohttp's web server (``aiohttp.web.Server`` parses
requests and writes answers; handlers see only this API) with agentenv's rules:

- keep-alive connections (HTTP/1.1, and HTTP/1.0 with ``Connection: keep-alive``);
  HTTP/1.1 requests must carry ``Host`` (RFC 9112), as aiohttp requires;
- request bodies with ``Content-Length`` only: a chunked (or any ``Transfer-Encoding``)
  request body is refused with 411, a malformed request with 400, an oversized head with
  431 and an oversized body with 413 -- the connection is then closed, the server is not;
- streamed responses (:class:`StreamingResponse`: chunked transfer, e.g. server-sent
  events);
- long-poll routes (``long_poll=True``): the handler is cancelled when the client
  disconnects or the server shuts down, so a waiting handler never hands its result to
  nobody (see :attr:`Response.on_undelivered`);
- a :class:`Guard` that sees each request's head before its body is read (authentication,
  e.g. SGLang's ``--api-key`` check);
- a connection cap (``max_connections``, below the descriptor limit by default): at the
  cap the longest-idle connection makes room, when all are busy a reserve answers probe
  routes (``probe=True``, health checks) and the rest get 503 (see ``agentenv/_http/_limits.py``);
- timeouts: idle connections close after ``keepalive_timeout``, a request head must
  arrive within ``head_timeout`` of its first byte and a body within
  ``request_timeout`` (408);
- a per-client limit (``client_limit``): requests of one client in flight at once,
  counted from the head (429 beyond, unread), so one client sending heads and half
  bodies cannot take every connection;
- JSON bodies (``Request.json``) nested at most 128 deep (400 beyond, never a
  RecursionError);
- graceful shutdown: leaving ``async with HTTPServer(...)`` stops accepting, closes idle
  connections, lets in-flight requests finish for ``shutdown_grace`` seconds, then cancels.

It binds to 127.0.0.1 unless told otherwise. Clients are aiohttp's or httpx's own
(agentenv's httpx clients send through aiohttp's pool). ::

    from agentenv.http import HTTPServer, Request, Response, Router

    router = Router()

    @router.route("GET", "/health")
    async def health(request: Request) -> Response:
        return Response.json({"ok": True})

    async with HTTPServer(router) as server:
        print(server.url)

``HTTPServer`` loads aiohttp on first use: clients never pay for it.
"""

from typing import TYPE_CHECKING, Any

from agentenv._http import (
    Guard,
    Handler,
    HTTPError,
    Request,
    Response,
    Router,
    StreamingResponse,
)

if TYPE_CHECKING:
    from agentenv._http import HTTPServer

__all__ = [
    "Guard",
    "HTTPError",
    "HTTPServer",
    "Handler",
    "Request",
    "Response",
    "Router",
    "StreamingResponse",
]


def __getattr__(name: str) -> Any:
    if name == "HTTPServer":
        from agentenv._http import HTTPServer

        return HTTPServer
    raise AttributeError(f"module 'agentenv.http' has no attribute {name!r}")
