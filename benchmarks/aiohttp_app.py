"""agentenv's HTTP handlers on a plain aiohttp application (``bench http``'s reference).

:func:`aiohttp_app` turns a :class:`~agentenv.http.Router` (and its server's ``guard``)
into an ``aiohttp.web.Application`` with nothing of ``HTTPServer``'s own layer (no
connection cap, head timeout or graceful shutdown): each aiohttp request becomes the
:class:`~agentenv.http.Request` the handler expects, and what it returns (or the
:class:`~agentenv.http.HTTPError` it raises) becomes the aiohttp response. The guard sees
the head before the body is read; a response that cannot be delivered runs its
``on_undelivered``. Only the benchmark imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from agentenv.http import Guard, Handler, HTTPError, Request, Response, Router, StreamingResponse

__all__ = ["aiohttp_app"]

log = logging.getLogger("benchmarks")

_AiohttpHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def aiohttp_app(router: Router, guard: Guard | None, *, max_body_bytes: int) -> web.Application:
    """An aiohttp application serving ``router``'s routes through their own handlers."""
    app = web.Application(client_max_size=max_body_bytes)
    for (method, path), handler in router.handlers().items():
        app.router.add_route(method, path, _adapt(handler, guard))
    return app


def _adapt(handler: Handler, guard: Guard | None) -> _AiohttpHandler:
    async def handle(request: web.Request) -> web.StreamResponse:
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        response: Response | StreamingResponse
        try:
            if guard is not None:
                guard(request.method, request.path, headers)
            body = await request.read()
            peer = request.transport.get_extra_info("peername") if request.transport else None
            version = f"HTTP/{request.version.major}.{request.version.minor}"
            ours = Request(
                request.method,
                request.path,
                dict(request.query),
                headers,
                body,
                version,
                peer if isinstance(peer, tuple) else None,
            )
            response = await handler(ours)
        except HTTPError as e:
            response = e.to_response()
        except Exception as e:
            log.exception("handler for %s %s failed", request.method, request.path)
            response = HTTPError(
                500, f"internal error: {type(e).__name__}: {e}", type="InternalError"
            ).to_response()
        if isinstance(response, StreamingResponse):
            return await _stream(request, response)
        out = web.Response(
            body=response.body,
            status=response.status,
            headers=[("content-type", response.content_type), *response.headers],
        )
        try:
            await out.prepare(request)
            await out.write_eof()
        except (ConnectionError, OSError):
            if response.on_undelivered is not None:
                await response.on_undelivered()
            raise
        return out

    return handle


async def _stream(request: web.Request, response: StreamingResponse) -> web.StreamResponse:
    out = web.StreamResponse(
        status=response.status,
        headers=[
            ("content-type", response.content_type),
            ("cache-control", "no-cache"),
            *response.headers,
        ],
    )
    out.enable_chunked_encoding()
    iterator = aiter(response.chunks)
    try:
        await out.prepare(request)
        async for chunk in iterator:
            if chunk:
                await out.write(chunk)
        await out.write_eof()
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
    return out
