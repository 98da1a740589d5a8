"""The client side: an httpx transport with a lean keep-alive connection pool."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import select
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import anyio.abc
import httpx
from anyio.abc import SocketAttribute

from agentenv._errors import ConfigError
from agentenv._http._common import CONNECTION_ERRORS, RECV_BYTES

__all__ = ["HTTPTransport", "RawResponse", "async_client"]


@dataclasses.dataclass(frozen=True, slots=True)
class RawResponse:
    """A whole response from :meth:`HTTPTransport.fetch` (the parts of ``httpx.Response``
    that JSON APIs use)."""

    status_code: int
    reason_phrase: str
    headers: list[tuple[bytes, bytes]]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def async_client(
    base_url: str,
    *,
    timeout: httpx.Timeout,
    max_connections: int,
    headers: dict[str, str] | None = None,
) -> httpx.AsyncClient:
    """An httpx client for one service: plain ``http://`` goes through
    :class:`HTTPTransport` (a fraction of httpx's default per-request cost), ``https://``
    keeps httpx's own transport. One pool of ``max_connections``; no proxies from the
    environment."""
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers or {},
        timeout=timeout,
        limits=httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        ),
        transport=HTTPTransport(max_connections=max_connections)
        if base_url.startswith("http://")
        else None,
        trust_env=False,
    )


class HTTPTransport(httpx.AsyncBaseTransport):
    """An httpx transport for plain HTTP/1.1 services on a trusted network.

    ``httpx.AsyncClient(transport=HTTPTransport())`` keeps httpx's API (timeouts, errors,
    streaming) but replaces its default connection layer, whose per-request cost (a pool
    scan with a readability check of every idle connection, a failed ``import sniffio``
    per lock) is several times this one's. Plain ``http://`` only: no TLS, no proxies, no
    HTTP/2. Request bodies are sent with ``Content-Length``; responses may be
    ``Content-Length``, chunked (server-sent events) or close-delimited.

    Args:
        max_connections: concurrent requests at most (further ones wait, up to the pool
            timeout).
        keepalive_expiry: seconds an idle connection is kept for reuse.
    """

    def __init__(self, *, max_connections: int = 100, keepalive_expiry: float = 5.0) -> None:
        if max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {max_connections}")
        self._slots = anyio.Semaphore(max_connections)
        self._idle: dict[tuple[str, int], list[_ClientConnection]] = {}
        self.keepalive_expiry = keepalive_expiry
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        idle = [c for conns in self._idle.values() for c in conns]
        self._idle.clear()
        for conn in idle:
            await conn.close()

    async def _checkout(self, key: tuple[str, int]) -> _ClientConnection | None:
        conns = self._idle.get(key)
        now = time.monotonic()
        while conns:
            conn = conns.pop()
            if now - conn.idle_since < self.keepalive_expiry and conn.reusable():
                return conn
            await conn.close()
        return None

    async def _checkin(self, conn: _ClientConnection) -> None:
        if self._closed:
            await conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"HTTPTransport speaks plain http:// only, got {url.scheme}:// "
                "(use httpx's default transport for TLS)"
            )
        if self._closed:
            raise RuntimeError("the transport is closed")
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        body = await request.aread()
        head = _request_head(request, len(body))
        key = (url.host, url.port or 80)
        try:
            with anyio.fail_after(timeouts.get("pool")):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no free connection in time") from None
        parts = [head + body] if len(body) <= 65536 else [head, body]
        status, reason, headers, stream = await self._open(
            key,
            parts,
            request.method,
            connect=timeouts.get("connect"),
            write=timeouts.get("write"),
            read=timeouts.get("read"),
        )
        return httpx.Response(
            status,
            headers=headers,
            stream=stream,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason.encode("latin-1")},
        )

    async def _open(
        self,
        key: tuple[str, int],
        parts: list[bytes],
        method: str,
        *,
        connect: float | None,
        write: float | None,
        read: float | None,
    ) -> tuple[int, str, list[tuple[bytes, bytes]], _ResponseBody]:
        """With a slot held: send the request on a pooled or new connection and read the
        response head. The returned body owns the connection and the slot; on failure the
        connection is closed and the slot released."""
        conn: _ClientConnection | None = None
        try:
            conn = await self._checkout(key)
            if conn is None:
                conn = await _ClientConnection.connect(key, connect)
            for part in parts:
                await conn.send(part, write)
            status, reason, headers, keep, framing = await conn.read_head(read, method)
        except BaseException:
            if conn is not None:
                await conn.close()
            self._slots.release()
            raise
        return status, reason, headers, _ResponseBody(self, conn, framing, keep, read)

    async def fetch(
        self,
        method: str,
        host: str,
        port: int,
        target: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        connect_timeout: float | None,
        timeout: float | None,  # noqa: ASYNC109 - one deadline for the whole exchange
    ) -> RawResponse:
        """One request, its whole response read, without httpx's request and response
        objects: the hot path of JSON clients (a fraction of the cost per call). One
        deadline, ``timeout``, covers the request; errors are httpx's exception types."""
        if self._closed:
            raise RuntimeError("the transport is closed")
        lines = [f"{method} {target} HTTP/1.1\r\nhost: {host}:{port}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"content-length: {len(body)}\r\n")
        lines.append("\r\n")
        data = "".join(lines).encode("latin-1") + body
        await self._slots.acquire()
        stream: _ResponseBody | None = None
        try:
            with anyio.fail_after(timeout):
                status, reason, raw_headers, stream = await self._open(
                    (host, port), [data], method, connect=connect_timeout, write=None, read=None
                )
                content = b"".join([piece async for piece in stream])
        except BaseException as e:
            if stream is not None:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()  # a no-op once the body was read whole
            if isinstance(e, TimeoutError):
                raise httpx.ReadTimeout(f"no whole answer within {timeout} s") from None
            raise
        return RawResponse(status, reason, raw_headers, content)


def _request_head(request: httpx.Request, length: int) -> bytes:
    url = request.url
    target = url.raw_path.decode("ascii")
    lines = [f"{request.method} {target} HTTP/1.1\r\n"]
    has_length = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"transfer-encoding":
            continue  # the body is whole: it goes with a Content-Length
        if lower == b"content-length":
            has_length = True
            value = str(length).encode()
        lines.append(f"{name.decode('latin-1')}: {value.decode('latin-1')}\r\n")
    if not has_length and (length or request.method in ("POST", "PUT", "PATCH")):
        lines.append(f"content-length: {length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class _ClientConnection:
    __slots__ = ("buf", "idle_since", "key", "sock", "stream")

    def __init__(self, key: tuple[str, int], stream: anyio.abc.SocketStream) -> None:
        self.key = key
        self.stream = stream
        self.sock = stream.extra(SocketAttribute.raw_socket)
        self.buf = bytearray()
        self.idle_since = 0.0

    @classmethod
    async def connect(cls, key: tuple[str, int], limit: float | None) -> _ClientConnection:
        try:
            with anyio.fail_after(limit):
                stream = await anyio.connect_tcp(*key)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from None
        except OSError as e:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {e}") from None
        return cls(key, stream)

    def reusable(self) -> bool:
        # An idle connection the server closed (or wrote to) must not carry a request: a
        # readable idle socket means end of stream or bytes nobody asked for.
        if self.buf:
            return False
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    async def close(self) -> None:
        # Closes at once (anyio aborts the transport): a half-used connection has nothing
        # worth flushing.
        self.buf.clear()
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.stream.aclose()

    async def send(self, data: bytes, limit: float | None) -> None:
        try:
            if limit is None:  # under a caller's deadline: no scope of its own
                await self.stream.send(data)
            else:
                with anyio.fail_after(limit):
                    await self.stream.send(data)
        except TimeoutError:
            raise httpx.WriteTimeout("sending the request timed out") from None
        except CONNECTION_ERRORS as e:
            raise httpx.WriteError(f"sending the request failed: {e!r}") from None

    async def fill(self, limit: float | None, max_bytes: int = RECV_BYTES) -> bool:
        try:
            if limit is None:
                data = await self.stream.receive(max_bytes)
            else:
                with anyio.fail_after(limit):
                    data = await self.stream.receive(max_bytes)
        except TimeoutError:
            raise httpx.ReadTimeout("reading the response timed out") from None
        except anyio.EndOfStream:
            return False
        except CONNECTION_ERRORS as e:
            raise httpx.ReadError(f"reading the response failed: {e!r}") from None
        self.buf += data
        return True

    async def read_head(
        self, limit: float | None, method: str
    ) -> tuple[int, str, list[tuple[bytes, bytes]], bool, int | str]:
        """Status, reason, headers, keep-alive, and the body's framing: a byte count,
        ``"chunked"`` or ``"close"``."""
        while True:
            start = 0
            while (end := self.buf.find(b"\r\n\r\n", start)) < 0:
                if len(self.buf) > 1 << 20:
                    raise httpx.RemoteProtocolError("the response head is over 1 MiB")
                start = max(0, len(self.buf) - 3)
                if not await self.fill(limit):
                    raise httpx.RemoteProtocolError(
                        "Server disconnected without sending a response."
                    )
            head = bytes(self.buf[:end]).decode("latin-1")
            del self.buf[: end + 4]
            line, *lines = head.split("\r\n")
            version, _, rest = line.partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()):
                raise httpx.RemoteProtocolError(f"malformed status line {line[:100]!r}")
            status = int(code)
            if 100 <= status < 200 and status != 101:
                continue  # 100 Continue and friends: the real answer follows
            break
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        connection = ""
        for raw in lines:
            name, sep, value = raw.partition(":")
            if not sep:
                raise httpx.RemoteProtocolError(f"malformed header line {raw[:100]!r}")
            value = value.strip(" \t")
            lower = name.strip().lower()
            if lower == "content-length":
                if not (value.isascii() and value.isdigit()):
                    raise httpx.RemoteProtocolError(f"bad Content-Length {value!r}")
                length = int(value)
            elif lower == "transfer-encoding":
                chunked = value.lower().endswith("chunked")
            elif lower == "connection":
                connection = value.lower()
            headers.append((name.encode("latin-1"), value.encode("latin-1")))
        keep = ("close" not in connection) if version == "HTTP/1.1" else "keep-alive" in connection
        framing: int | str
        if method == "HEAD" or status in (204, 304):
            framing = 0
        elif chunked:
            framing = "chunked"
        elif length is not None:
            framing = length
        else:
            framing, keep = "close", False
        return status, reason, headers, keep, framing


class _ResponseBody(httpx.AsyncByteStream):
    """A response body read off the connection as the caller iterates; the connection goes
    back to the pool once the body is read whole (or is closed otherwise)."""

    def __init__(
        self,
        transport: HTTPTransport,
        conn: _ClientConnection,
        framing: int | str,
        keep: bool,
        timeout: float | None,
    ) -> None:
        self._transport = transport
        self._conn: _ClientConnection | None = conn
        self._framing = framing
        self._keep = keep
        self._timeout = timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        if conn is None:
            return
        framing = self._framing
        if isinstance(framing, int):
            async for piece in self._counted(conn, framing):
                yield piece
        elif framing == "chunked":
            while True:
                line = await self._line(conn)
                size_text = line.split(";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"bad chunk size {size_text!r}") from None
                if size == 0:
                    while await self._line(conn):  # trailers, up to the blank line
                        pass
                    break
                async for piece in self._counted(conn, size):
                    yield piece
                if await self._line(conn):
                    raise httpx.RemoteProtocolError("a chunk is longer than its size")
        else:  # until the server closes
            if conn.buf:
                yield bytes(conn.buf)
                conn.buf.clear()
            while await conn.fill(self._timeout):
                yield bytes(conn.buf)
                conn.buf.clear()
        await self._finish(reuse=self._keep)

    async def _counted(self, conn: _ClientConnection, n: int) -> AsyncIterator[bytes]:
        while n:
            if not conn.buf and not await conn.fill(self._timeout, min(n, 1 << 20)):
                raise httpx.RemoteProtocolError("the server closed the connection mid-body")
            take = min(n, len(conn.buf))
            with memoryview(conn.buf) as view:
                piece = bytes(view[:take])
            del conn.buf[:take]
            n -= take
            yield piece

    async def _line(self, conn: _ClientConnection) -> str:
        while (end := conn.buf.find(b"\r\n")) < 0:
            if len(conn.buf) > 65536:
                raise httpx.RemoteProtocolError("a chunk header is over 64 KiB")
            if not await conn.fill(self._timeout):
                raise httpx.RemoteProtocolError("the server closed the connection mid-body")
        line = bytes(conn.buf[:end]).decode("latin-1")
        del conn.buf[: end + 2]
        return line

    async def _finish(self, *, reuse: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._transport._slots.release()
        if reuse and not conn.buf:
            await self._transport._checkin(conn)
        else:
            await conn.close()

    async def aclose(self) -> None:
        await self._finish(reuse=False)  # a body not read to its end leaves the connection unusable
