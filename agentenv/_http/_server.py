"""The HTTP server: agentenv's routes on aiohttp's web server.

aiohttp (its low-level ``web.Server`` and its ``RequestHandler`` protocol) parses the
requests and writes the answers; this module accepts the connections itself (to count
them against the cap, see ``_limits.py``), turns each aiohttp request into the
:class:`Request` a handler takes and what it returns into aiohttp's response, and stops
gracefully.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Mapping
from typing import Any, cast

import anyio
import anyio.abc
from aiohttp import web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_request import BaseRequest
from anyio.abc import SocketAttribute

from agentenv._errors import ClosedResourceError, ConfigError
from agentenv._http._api import (
    Guard,
    Handler,
    HTTPError,
    Request,
    Response,
    Router,
    StreamingResponse,
)
from agentenv._http._connection import Connection, Connections
from agentenv._http._limits import (
    DEFAULT_RESERVE,
    MAX_BODY_BYTES,
    ClientLimit,
    InFlight,
    Slots,
    default_max_connections,
)

__all__ = ["HTTPServer"]

log = logging.getLogger("agentenv.http")

_LINGER_S = 1.0  # after refusing a body, how long the rest of it is read and dropped
_CLOSE_S = 1.0  # at shutdown, how long closing connections get to flush their answers


def _shutting_down() -> HTTPError:
    return HTTPError(
        503, "the server is shutting down; retry against its successor", type="ShuttingDown"
    )


class HTTPServer:
    """Serves a :class:`Router` over HTTP/1.1 on a TCP port; an async context manager.

    Args:
        router: the routes.
        host: interface to bind; ``127.0.0.1`` (loopback only) unless you mean otherwise.
        port: TCP port; 0 picks a free one (read :attr:`port` after start).
        max_header_bytes: request line plus headers, at most (431 beyond).
        max_body_bytes: request body, at most (413 beyond).
        keepalive_timeout: seconds an idle connection (kept alive between requests, or
            new and silent) stays open.
        head_timeout: seconds from a request's first byte to the end of its head (408
            beyond); until then the connection counts as idle (``_limits.py``).
        request_timeout: seconds to receive one request's body once its head is read
            (408 beyond).
        shutdown_grace: on exit, seconds in-flight requests get to finish before they
            are cancelled (long-poll requests are answered 503 at once).
        guard: called with ``(method, path, headers)`` of every request before its body
            is read; it raises :class:`HTTPError` to refuse it (e.g. 401), and then the
            body is never read and the connection is closed.
        max_connections: connections held at once (default: three quarters of the file
            descriptors this process may open); what happens at the cap: ``_limits.py``.
        reserve_connections: connections beyond the cap that only answer probe routes
            (health checks), so that a saturated server still says it is alive.
        client_limit: requests in flight per client, at most (see
            :class:`~agentenv._http._limits.ClientLimit`): one client sending heads and
            half bodies cannot take every connection.
        hints: how a user raises a limit, by setting name (``"max_body_bytes"``,
            ``"request_timeout"``), said in the answer that limit gives.
    """

    def __init__(
        self,
        router: Router,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_header_bytes: int = 64 * 1024,
        max_body_bytes: int = MAX_BODY_BYTES,
        keepalive_timeout: float = 10.0,
        head_timeout: float = 10.0,
        request_timeout: float = 60.0,
        shutdown_grace: float = 5.0,
        guard: Guard | None = None,
        max_connections: int | None = None,
        reserve_connections: int = DEFAULT_RESERVE,
        client_limit: ClientLimit | None = None,
        hints: Mapping[str, str] | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {port}")
        if max_connections is None:
            max_connections = default_max_connections()
        for name, value, least in (
            ("max_header_bytes", max_header_bytes, 1),
            ("max_body_bytes", max_body_bytes, 1),
            ("max_connections", max_connections, 1),
            ("reserve_connections", reserve_connections, 0),
        ):
            if value < least:
                raise ConfigError(f"{name} must be at least {least}, got {value}")
        for name, seconds in (
            ("keepalive_timeout", keepalive_timeout),
            ("head_timeout", head_timeout),
            ("request_timeout", request_timeout),
        ):
            if not seconds > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {seconds}")
        if not shutdown_grace >= 0:
            raise ConfigError(f"shutdown_grace must be >= 0 seconds, got {shutdown_grace}")
        self.router = router
        self.host = host
        self._port = port
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.keepalive_timeout = keepalive_timeout
        self.head_timeout = head_timeout
        self.request_timeout = request_timeout
        self.shutdown_grace = shutdown_grace
        self.guard = guard
        self.max_connections = max_connections
        self._slots = Slots(max_connections, reserve_connections)
        self._in_flight = InFlight(client_limit) if client_limit is not None else None
        self._clients: dict[asyncio.Task[Any], str] = {}  # requests counted in _in_flight
        self._hints = dict(hints or {})
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        self._manager: web.Server | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._done = anyio.Event()
        self._accepting = anyio.CancelScope()
        self._conns = Connections(
            self._slots, head_timeout=head_timeout, max_header_bytes=max_header_bytes
        )
        # aiohttp's settings for each connection's protocol (RequestHandler).
        self._protocol_settings: dict[str, Any] = {
            "keepalive_timeout": keepalive_timeout,
            "max_line_size": max_header_bytes,
            "max_field_size": max_header_bytes,
            "max_headers": max(1, max_header_bytes // 4),  # the byte bound comes first
            "lingering_time": _LINGER_S,
            "access_log": None,
            "auto_decompress": False,  # bodies are taken as sent, as they were measured
        }
        self._polls: set[anyio.CancelScope] = set()  # long-poll handlers running
        self._tasks: set[asyncio.Task[Any]] = set()  # request handlers running

    @property
    def port(self) -> int:
        """The bound TCP port (after start)."""
        if self._listener is None:
            raise ClosedResourceError("the server is not started: use `async with HTTPServer(...)`")
        port: int = self._listener.extra(SocketAttribute.local_port)
        return port

    @property
    def url(self) -> str:
        """``http://host:port`` (after start)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections open now (counted against ``max_connections``)."""
        return self._slots.open

    async def __aenter__(self) -> HTTPServer:
        if self._conns.closing or self._listener is not None:
            raise ClosedResourceError("an HTTPServer can be started once")
        try:
            self._listener = await anyio.create_tcp_listener(
                local_host=self.host, local_port=self._port
            )
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {self.host}:{self._port}: {e.strerror or e}; "
                "choose another --host/--port (port 0 picks a free one)"
            ) from None
        self._manager = web.Server(self._serve, request_factory=self._request)
        # The task group only runs the accept loop, so stopping it never cancels the
        # code inside `async with server:`.
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        await tg.start(self._run)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self.aclose(graceful=exc_info[0] is None)
        finally:
            self._accepting.cancel()  # in case aclose was interrupted
            if self._tg is not None:
                await self._tg.__aexit__(*exc_info)

    async def aclose(self, *, graceful: bool = True) -> None:
        """Stop: no new connections; in-flight requests get ``shutdown_grace`` seconds
        (``graceful=False``: none), then are cancelled. Idle keep-alive connections are
        closed at once; long-poll requests are answered 503 at once."""
        if self._conns.closing:
            if self._manager is not None:
                await self._done.wait()
            return
        self._conns.close()
        self._accepting.cancel()
        self._slots.close_idle()
        for scope in self._polls:
            scope.cancel()
        if self._manager is None:  # never started
            return
        try:
            if graceful:
                with anyio.move_on_after(self.shutdown_grace):
                    await self._conns.quiet.wait()
            for task in self._tasks:
                task.cancel()
            with anyio.move_on_after(_CLOSE_S):
                await self._conns.all_closed.wait()
        finally:  # (also when the wait is interrupted)
            for task in self._tasks:
                task.cancel()
            for conn in list(self._conns.open):  # answers nobody reads: drop them
                if conn.transport is not None:
                    conn.transport.abort()
                else:
                    self._conns.lost(conn)
            self._conns.all_closed.set()
        with anyio.CancelScope(shield=True):
            await self._done.wait()

    # -- accepting ----------------------------------------------------------------------
    async def _run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        assert self._listener is not None
        self._slots.hold_spare()
        try:
            task_status.started()
            with self._accepting:
                listeners = getattr(self._listener, "listeners", [self._listener])
                async with anyio.create_task_group() as accepting:
                    for listener in listeners:
                        sock = listener.extra(SocketAttribute.raw_socket)
                        accepting.start_soon(self._accept, sock)
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
            self._slots.release_spare()
            self._done.set()

    async def _accept(self, sock: socket.socket) -> None:
        # Waits for readability, then accepts in this task. (Cancelling an accept that the
        # event loop has already completed leaks the accepted socket, which leaves its
        # client waiting forever.)
        assert self._manager is not None
        loop = asyncio.get_running_loop()
        while True:
            await anyio.wait_readable(sock)
            try:
                client, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as e:  # out of file descriptors and the like
                if not self._slots.refuse_with_spare(sock, e):
                    log.warning("accepting a connection failed: %s", e)
                    await anyio.sleep(0.1)  # back off
                continue
            conn = Connection(self._conns, self._manager, **self._protocol_settings)
            admission = self._slots.admit(conn)
            if admission == "refuse":
                self._slots.refuse(client)
                continue
            conn.probe_only = admission == "probe"
            try:
                client.setblocking(False)
                with anyio.CancelScope(shield=True):  # once begun, the transport is made
                    await loop.connect_accepted_socket(functools.partial(_same, conn), client)
            except (OSError, ValueError):  # reset before we got to it: not our problem
                self._slots.leave(conn)
                client.close()

    # -- one request ----------------------------------------------------------------------
    def _request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: web.RequestHandler,
        writer: Any,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        # aiohttp calls this as it takes a request (or a parse error) off its queue.
        cast(Connection, protocol).begin(payload)
        return BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop())

    async def _serve(self, raw: BaseRequest) -> web.StreamResponse:
        conn = cast(Connection, raw.protocol)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            answer, keep = await self._answer(raw, conn)
            keep = keep and not self._conns.closing and not conn.probe_only
            if answer is None or conn.gone:  # the client left while the handler ran
                if isinstance(answer, Response):
                    await _undelivered(answer)
                conn.close_now()
                return web.Response()  # written to nobody
            if isinstance(answer, StreamingResponse):
                return await _stream(raw, answer, keep)
            return await _respond(raw, answer, keep)
        finally:
            self._tasks.discard(task)
            client = self._clients.pop(task, None)
            if client is not None and self._in_flight is not None:
                self._in_flight.give(client)
            conn.end()

    async def _answer(
        self, raw: BaseRequest, conn: Connection
    ) -> tuple[Response | StreamingResponse | None, bool]:
        """The handler's answer (None: the client left) and whether to keep the connection."""
        refusal = self.router.refusal
        if self._conns.closing:  # a request that arrived on a kept-alive connection meanwhile
            return refusal(raw.method, raw.path, _shutting_down()), False
        try:
            request = await self._read(raw, conn)
        except HTTPError as e:  # refused before its body was read: answer, then close
            return refusal(raw.method, raw.path, e), False
        if request is None:
            return None, False
        response: Response | StreamingResponse | None
        try:
            route = self.router.resolve(request.method, request.path)
            if conn.probe_only and not route.probe:
                raise HTTPError(
                    503,
                    f"the server holds its maximum of {self.max_connections} connections; "
                    "retry shortly",
                    type="ServiceUnavailable",
                    headers=[("retry-after", "1")],
                )
            if route.long_poll:
                response = await self._long_poll(route.handler, request, conn)
            else:
                response = await route.handler(request)
        except HTTPError as e:
            response = refusal(request.method, request.path, e)
        except Exception as e:
            log.exception("handler for %s %s failed", request.method, request.path)
            error = HTTPError(500, f"internal error: {type(e).__name__}: {e}", type="InternalError")
            response = refusal(request.method, request.path, error)
        return response, True

    async def _read(self, raw: BaseRequest, conn: Connection) -> Request | None:
        """The whole request, its head checked (guard, sizes) before its body is read;
        None if the client left before its body arrived."""
        version = raw.version
        if (version.major, version.minor) not in ((1, 1), (1, 0)):
            conn.refuse(  # in HTTP/1.1 (aiohttp would answer in the request's version)
                505,
                "HTTPVersionNotSupported",
                f"unsupported protocol HTTP/{version.major}.{version.minor}; "
                "this server speaks HTTP/1.1",
            )
            return None
        # (A head that arrives in pieces is bounded as it arrives, see Connection.)
        size = len(raw.raw_path) + sum(len(k) + len(v) + 4 for k, v in raw.raw_headers)
        if size > self.max_header_bytes:
            raise HTTPError(
                431,
                f"the request head is over {self.max_header_bytes} bytes",
                type="RequestHeaderFieldsTooLarge",
            )
        headers: dict[str, str] = {}
        for name, value in raw.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        method, path = raw.method, raw.path
        if self.guard is not None:
            self.guard(method, path, headers)
        if "transfer-encoding" in headers:
            raise HTTPError(
                411,
                "request bodies with Transfer-Encoding "
                f"({headers['transfer-encoding']!r}) are not supported: send the body "
                "with a Content-Length header",
                type="LengthRequired",
            )
        n = raw.content_length or 0
        if n > self.max_body_bytes:
            raise HTTPError(
                413,
                f"the request body is {n} bytes; this server takes at most "
                f"{self.max_body_bytes}{self._hint('max_body_bytes')}",
                type="ContentTooLarge",
            )
        if self._in_flight is not None:  # counted before its body is waited for
            client = self._in_flight.take(method, path, headers)
            task = asyncio.current_task()
            if client is not None and task is not None:
                self._clients[task] = client
        body = b""
        if n:
            if headers.get("expect", "").lower() == "100-continue":
                await raw.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                with anyio.fail_after(self.request_timeout):
                    body = await raw.content.readexactly(n)
            except TimeoutError:
                raise HTTPError(
                    408,
                    f"the request body took over {self.request_timeout:g} s to arrive"
                    f"{self._hint('request_timeout')}",
                ) from None
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                return None
        peer = conn.peername
        return Request(
            method,
            path,
            dict(raw.query.items()),
            headers,
            body,
            f"HTTP/{version.major}.{version.minor}",
            peer if isinstance(peer, tuple) and len(peer) == 2 else None,
        )

    def _hint(self, setting: str) -> str:
        hint = self._hints.get(setting)
        return f" ({hint})" if hint else ""

    async def _long_poll(
        self, handler: Handler, request: Request, conn: Connection
    ) -> Response | StreamingResponse | None:
        # Cancelled when the client disconnects (None) or the server shuts down (503).
        result: Response | StreamingResponse | None = None
        with anyio.CancelScope() as scope:
            self._polls.add(scope)
            conn.polls.add(scope)
            try:
                if self._conns.closing or conn.gone:
                    scope.cancel()
                result = await handler(request)
            finally:
                self._polls.discard(scope)
                conn.polls.discard(scope)
        if result is None and not conn.gone:
            raise _shutting_down()
        return result


def _same(conn: Connection) -> Connection:
    return conn


# (aiohttp refuses a header that would break the head, a CR or LF in it: a 500.)
async def _respond(raw: BaseRequest, response: Response, keep: bool) -> web.StreamResponse:
    headers = [("content-type", response.content_type), *response.headers]
    out = web.Response(body=response.body, status=response.status, headers=headers)
    if not keep:
        out.force_close()
    try:
        await out.prepare(raw)
        await out.write_eof()
    except (ConnectionError, OSError):
        await _undelivered(response)
    return out


async def _stream(raw: BaseRequest, response: StreamingResponse, keep: bool) -> web.StreamResponse:
    headers = [
        ("content-type", response.content_type),
        ("cache-control", "no-cache"),
        *response.headers,
    ]
    iterator = aiter(response.chunks)
    try:
        out = web.StreamResponse(status=response.status, headers=headers)
        if raw.version == (1, 1):
            out.enable_chunked_encoding()
        else:  # HTTP/1.0: the body ends when the connection does
            keep = False
        if not keep:
            out.force_close()
        try:
            await out.prepare(raw)
            if raw.method != "HEAD":
                async for chunk in iterator:
                    if chunk:
                        await out.write(chunk)
            await out.write_eof()
        except (ConnectionError, OSError):
            cast(Connection, raw.protocol).close_now()
        return out
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            with anyio.CancelScope(shield=True):
                await close()


async def _undelivered(response: Response) -> None:
    if response.on_undelivered is None:
        return
    try:
        with anyio.CancelScope(shield=True):
            await response.on_undelivered()
    except Exception:
        log.exception("on_undelivered callback failed")
