"""The HTTP/1.1 layer agentenv's own services are built on (the Buffer service,
``agentenv serve``, the per-episode endpoint), for a service of one's own built the same
way, and for measuring it (``agentenv bench http``, ``agentenv bench agent``).

A :class:`Router` maps ``(method, path)`` to ``async def handler(request) -> response``
(:class:`Request` in; :class:`Response` or :class:`StreamingResponse` out; raise
:class:`HTTPError` for an error status, a :class:`Guard` sees each head before its body);
:class:`HTTPServer` serves it on aiohttp's web server with agentenv's connection rules
(its connection cap, timeouts, per-client limit and graceful shutdown: see
``agentenv/_http/__init__.py``). Clients are aiohttp's or httpx's own. ::

    from agentenv.http import HTTPServer, Request, Response, Router

    router = Router()

    @router.route("GET", "/health")
    async def health(request: Request) -> Response:
        return Response.json({"ok": True})

    async with HTTPServer(router) as server:
        print(server.url)

``HTTPServer`` loads aiohttp on first use.
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
        from agentenv import _http

        return _http.HTTPServer
    raise AttributeError(f"module 'agentenv.http' has no attribute {name!r}")
