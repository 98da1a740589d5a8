"""An httpx transport over aiohttp's connection pool, for the clients that must speak httpx.

The OpenAI and Anthropic SDKs take an ``httpx.AsyncClient`` (the endpoint's shared
``http_client``), and :class:`~agentenv.buffer.BufferClient` is written against httpx's
API. httpx's own pool scans every connection on each request: 4.6 ms of CPU a request at
256 in flight against aiohttp's 0.3 ms (``agentenv bench client``, docs/benchmarks.md).
``httpx.AsyncClient(transport=AiohttpTransport(max_connections=N))`` keeps httpx's API
(timeouts, errors, streaming) over ``aiohttp.ClientSession``'s pool.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
import httpx

from agentenv._errors import ConfigError

if TYPE_CHECKING:
    import aiohttp

__all__ = ["AiohttpTransport"]

# Framing is aiohttp's to write: the body goes whole, with its Content-Length.
_FRAMING = (b"content-length", b"transfer-encoding")


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests sent through one ``aiohttp.ClientSession`` of ``max_connections``
    (made on first use, in the event loop). Plain HTTP/1.1; no proxies from the
    environment; redirects and decompression stay httpx's."""

    def __init__(self, *, max_connections: int = 100) -> None:
        if max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _pool(self) -> aiohttp.ClientSession:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=None),
                auto_decompress=False,
                trust_env=False,
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import aiohttp
        import yarl

        timeouts = request.extensions.get("timeout", {})
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in request.headers.raw
            if name.lower() not in _FRAMING
        ]
        body = await request.aread()
        data: bytes | io.BytesIO | None = None
        if body or request.method in ("POST", "PUT", "PATCH"):
            # (aiohttp sends a body of over 1 MiB from a file object, a piece at a time.)
            data = io.BytesIO(body) if len(body) > 1 << 20 else bytes(body)
        try:
            answer = await self._pool().request(
                request.method,
                yarl.URL(str(request.url), encoded=True),
                headers=headers,
                data=data,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=timeouts.get("connect"),
                    sock_read=timeouts.get("read"),
                ),
            )
        except aiohttp.ConnectionTimeoutError as e:
            raise httpx.ConnectTimeout(f"connecting to {request.url} timed out") from e
        except TimeoutError as e:
            raise httpx.ReadTimeout(f"no answer from {request.url} in time") from e
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(f"cannot connect to {request.url}: {e}") from e
        except aiohttp.ClientError as e:
            raise httpx.ReadError(f"{request.method} {request.url} failed: {e!r}") from e
        return httpx.Response(
            answer.status,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in answer.raw_headers],
            stream=_Body(answer),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (answer.reason or "").encode("latin-1"),
            },
        )

    async def aclose(self) -> None:
        if self._session is not None:
            with anyio.CancelScope(shield=True):  # closing completes, even when cancelled
                await self._session.close()


class _Body(httpx.AsyncByteStream):
    """An aiohttp response's body as httpx reads it; its connection goes back to the pool
    once read whole, and is closed otherwise."""

    def __init__(self, answer: aiohttp.ClientResponse) -> None:
        self._answer = answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for chunk in self._answer.content.iter_any():
                yield chunk
        except TimeoutError as e:
            raise httpx.ReadTimeout("reading the response timed out") from e
        except aiohttp.ClientError as e:
            raise httpx.ReadError(f"reading the response failed: {e!r}") from e

    async def aclose(self) -> None:
        self._answer.release()
