"""The HTTP/1.1 server: routes, keep-alive connections, long polls, streamed responses."""

from __future__ import annotations

import dataclasses
import http
import json
import logging
import socket
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from agentenv._errors import AgentEnvError, ClosedResourceError, ConfigError
from agentenv._http._common import CONNECTION_ERRORS, RECV_BYTES
from agentenv._http._limits import DEFAULT_RESERVE, Slots, default_max_connections

__all__ = [
    "Guard",
    "HTTPError",
    "HTTPServer",
    "Handler",
    "Request",
    "Response",
    "Router",
    "StreamingResponse",
    "sse",
]

log = logging.getLogger("agentenv.http")


class HTTPError(AgentEnvError):
    """Raise in a handler to answer ``status`` with ``{"error": {"type", "message"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _phrase(status).replace(" ", "")
        self.headers = headers or []

    def to_response(self) -> Response:
        return Response.json(
            {"error": {"type": self.type, "message": self.message}},
            status=self.status,
            headers=self.headers,
        )


@dataclasses.dataclass(slots=True)
class Request:
    """One parsed request. Header names are lower-case; ``body`` is the whole body."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    http_version: str = "HTTP/1.1"
    client: tuple[str, int] | None = None

    def json(self) -> Any:
        """The body as JSON; :class:`HTTPError` 400 when it is not."""
        try:
            return json.loads(self.body)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise HTTPError(400, f"the request body is not valid JSON: {e}") from None


@dataclasses.dataclass(slots=True)
class Response:
    """A complete response.

    ``on_undelivered`` (optional) is awaited when the response could not be handed to the
    client (it disconnected before or while it was written): a handler that took something
    out of a queue uses it to put it back. It is best-effort -- bytes accepted by the
    kernel count as delivered.
    """

    body: bytes = b""
    status: int = 200
    content_type: str = "application/octet-stream"
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    on_undelivered: Callable[[], Awaitable[None]] | None = None

    @classmethod
    def json(
        cls, data: Any, *, status: int = 200, headers: list[tuple[str, str]] | None = None
    ) -> Response:
        body = json.dumps(data, separators=(",", ":"), allow_nan=False).encode()
        return cls(body, status, "application/json", headers or [])

    @classmethod
    def text(cls, text: str, *, status: int = 200) -> Response:
        return cls(text.encode(), status, "text/plain; charset=utf-8")

    @classmethod
    def empty(cls, status: int = 204) -> Response:
        return cls(b"", status)


@dataclasses.dataclass(slots=True)
class StreamingResponse:
    """A response whose body is produced while it is sent (chunked transfer encoding).

    Each non-empty item of ``chunks`` is sent as soon as it is produced. If the client goes
    away the iterator is closed (``aclose``), so an async generator's ``finally`` runs.
    """

    chunks: AsyncIterable[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = dataclasses.field(default_factory=list)


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]
"""``async def handler(request: Request) -> Response | StreamingResponse``."""


Guard = Callable[[str, str, Mapping[str, str]], None]
"""``guard(method, path, headers)``: raise :class:`HTTPError` to refuse a request unread."""


def sse(data: str, *, event: str | None = None, id: str | None = None) -> bytes:
    """One server-sent event (``data: ...`` lines and a blank line) as bytes."""
    lines = []
    if event is not None:
        lines.append(f"event: {event}")
    if id is not None:
        lines.append(f"id: {id}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode()


@dataclasses.dataclass(frozen=True, slots=True)
class _Route:
    handler: Handler
    long_poll: bool
    probe: bool = False


class Router:
    """Handlers by exact ``(method, path)``; unknown paths answer 404, wrong methods 405."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], _Route] = {}
        self._methods: dict[str, list[str]] = {}

    def add(
        self,
        method: str,
        path: str,
        handler: Handler,
        *,
        long_poll: bool = False,
        probe: bool = False,
    ) -> None:
        """Route ``method path`` to ``handler``.

        ``long_poll=True`` for handlers that may wait long (for data, for room): they are
        cancelled when the client disconnects, and answer 503 when the server shuts down.
        ``probe=True`` for a health check: still answered when every connection is busy
        (on the server's reserved connections).
        """
        method = method.upper()
        if not path.startswith("/"):
            raise ConfigError(f"a route path must start with '/', got {path!r}")
        if (method, path) in self._routes:
            raise ConfigError(f"route {method} {path} is already registered")
        self._routes[method, path] = _Route(handler, long_poll, probe)
        self._methods.setdefault(path, []).append(method)

    def route(
        self, method: str, path: str, *, long_poll: bool = False, probe: bool = False
    ) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`add`."""

        def register(handler: Handler) -> Handler:
            self.add(method, path, handler, long_poll=long_poll, probe=probe)
            return handler

        return register

    def resolve(self, method: str, path: str) -> _Route:
        route = self._routes.get((method, path))
        if route is None and method == "HEAD":
            route = self._routes.get(("GET", path))
        if route is not None:
            return route
        allowed = self._methods.get(path)
        if allowed is None:
            raise HTTPError(404, f"no route for {path!r}", type="NotFound")
        raise HTTPError(
            405,
            f"{method} is not allowed on {path!r}; use {', '.join(sorted(allowed))}",
            type="MethodNotAllowed",
            headers=[("allow", ", ".join(sorted(allowed)))],
        )


_PHRASES: dict[int, str] = {s.value: s.phrase for s in http.HTTPStatus}


def _phrase(status: int) -> str:
    return _PHRASES.get(status, "")


def _check_header(name: str, value: str) -> None:
    if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"invalid response header {name!r}: {value!r}")


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
            beyond). Until its head is complete a connection counts as idle: at the cap
            it may be closed to make room, so half-sent heads cannot lock clients out.
        request_timeout: seconds to receive one request's body once its head is read
            (408 beyond).
        shutdown_grace: on exit, seconds in-flight requests get to finish before they
            are cancelled (long-poll requests are cancelled at once).
        guard: called with ``(method, path, headers)`` of every request before its body
            is read; it raises :class:`HTTPError` to refuse it (e.g. 401), and then the
            body is never read and the connection is closed.
        max_connections: connections held at once (default: three quarters of the file
            descriptors this process may open, see ``_limits.py``). At the cap the
            connection waiting longest (idle, or still sending its request head) is closed
            to make room; when all are busy, a new one gets 503.
        reserve_connections: connections beyond the cap that only answer probe routes
            (health checks), so that a saturated server still says it is alive; a
            request is known to be a probe once its head is read.
    """

    def __init__(
        self,
        router: Router,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_header_bytes: int = 64 * 1024,
        max_body_bytes: int = 64 * 1024 * 1024,
        keepalive_timeout: float = 10.0,
        head_timeout: float = 10.0,
        request_timeout: float = 60.0,
        shutdown_grace: float = 5.0,
        guard: Guard | None = None,
        max_connections: int | None = None,
        reserve_connections: int = DEFAULT_RESERVE,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {port}")
        for name, value in (
            ("max_header_bytes", max_header_bytes),
            ("max_body_bytes", max_body_bytes),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        for name, seconds in (
            ("keepalive_timeout", keepalive_timeout),
            ("head_timeout", head_timeout),
            ("request_timeout", request_timeout),
        ):
            if not seconds > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {seconds}")
        if not shutdown_grace >= 0:
            raise ConfigError(f"shutdown_grace must be >= 0 seconds, got {shutdown_grace}")
        if max_connections is None:
            max_connections = default_max_connections()
        if max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {max_connections}")
        if reserve_connections < 0:
            raise ConfigError(f"reserve_connections must be at least 0, got {reserve_connections}")
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
        self._listener: anyio.abc.Listener[anyio.abc.SocketStream] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._conns: anyio.abc.TaskGroup | None = None
        self._done = anyio.Event()
        self._accepting = anyio.CancelScope()
        self._closing = False
        self._closed = False
        self._polls: set[anyio.CancelScope] = set()  # long-poll handlers running
        self._busy = 0  # requests being handled
        self._quiet = anyio.Event()

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

    async def __aenter__(self) -> HTTPServer:
        if self._closed or self._listener is not None:
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
        # The outer task group only runs `_run`; connections live in `_run`'s own group,
        # so stopping them never cancels the code inside `async with server:`.
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        await tg.start(self._run)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self.aclose(graceful=exc_info[0] is None)
        finally:
            if self._conns is not None:  # in case aclose was interrupted
                self._conns.cancel_scope.cancel()
            if self._tg is not None:
                await self._tg.__aexit__(*exc_info)

    async def serve_forever(self) -> None:
        """Start, and serve until cancelled (Ctrl-C)."""
        async with self:
            await anyio.sleep_forever()

    async def aclose(self, *, graceful: bool = True) -> None:
        """Stop: no new connections; in-flight requests get ``shutdown_grace`` seconds
        (``graceful=False``: none), then are cancelled. Idle keep-alive connections are
        closed at once; long-poll requests are answered 503 at once."""
        if self._closed:
            if self._conns is not None:
                await self._done.wait()
            return
        self._closed = self._closing = True
        self._accepting.cancel()
        self._slots.close_idle()
        for scope in self._polls:
            scope.cancel()
        if self._conns is None:  # never started
            return
        if graceful and self._busy:
            with anyio.move_on_after(self.shutdown_grace):
                await self._quiet.wait()
        self._conns.cancel_scope.cancel()
        await self._done.wait()

    @property
    def connections(self) -> int:
        """Connections open now (counted against ``max_connections``)."""
        return self._slots.open

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        assert self._listener is not None
        self._slots.hold_spare()
        try:
            async with anyio.create_task_group() as conns:
                self._conns = conns
                task_status.started()
                with self._accepting:
                    listeners = getattr(self._listener, "listeners", [self._listener])
                    async with anyio.create_task_group() as accepting:
                        for listener in listeners:
                            sock = listener.extra(SocketAttribute.raw_socket)
                            accepting.start_soon(self._accept, sock, conns)
        finally:
            with anyio.CancelScope(shield=True):
                await self._listener.aclose()
            self._slots.release_spare()
            self._done.set()

    async def _accept(self, sock: socket.socket, conns: anyio.abc.TaskGroup) -> None:
        # Waits for readability, then accepts in this task. (Cancelling an accept that the
        # event loop has already completed leaks the accepted socket, which leaves its
        # client waiting forever: the listener's own accept loop cannot be stopped safely.)
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
            conn = _Connection(self, None, None)
            admission = self._slots.admit(conn)
            if admission == "refuse":
                self._slots.refuse(client)
                continue
            conn.probe_only = admission == "probe"
            try:
                client.setblocking(False)
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                stream = await anyio.abc.SocketStream.from_socket(client)
            except (OSError, ValueError):  # reset before we got to it: not our problem
                self._slots.leave(conn)
                client.close()
                continue
            except BaseException:
                self._slots.leave(conn)
                client.close()
                raise
            conn.stream = stream
            conns.start_soon(self._connection, conn)

    async def _connection(self, conn: _Connection) -> None:
        stream = conn.stream
        try:
            client = stream.extra(SocketAttribute.remote_address)
        except (OSError, anyio.TypedAttributeLookupError):  # pragma: no cover - gone already
            client = None
        conn.client = client if isinstance(client, tuple) else None
        try:
            await conn.run()
        except CONNECTION_ERRORS:
            pass
        except Exception:  # a bug here must not take the server down
            log.exception("HTTP connection failed")
        finally:
            self._slots.leave(conn)
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    def _begin(self) -> None:
        self._busy += 1

    def _end(self) -> None:
        self._busy -= 1
        if self._closing and not self._busy:
            self._quiet.set()


class _Connection:
    """One client connection: read a request, answer it, repeat while kept alive."""

    __slots__ = ("buf", "client", "gone", "probe_only", "server", "stream")

    def __init__(
        self,
        server: HTTPServer,
        stream: anyio.abc.SocketStream | None,
        client: tuple[str, int] | None,
    ) -> None:
        self.server = server
        # None only between accept and the stream's creation (admission comes first).
        self.stream: anyio.abc.SocketStream = stream  # type: ignore[assignment]
        self.client = client
        self.buf = bytearray()
        self.gone = False  # the client disconnected while a long-poll handler ran
        self.probe_only = False  # beyond the cap: one request, answered only if a probe

    async def _fill(self) -> bool:
        try:
            data = await self.stream.receive(RECV_BYTES)
        except CONNECTION_ERRORS:
            return False
        self.buf += data
        return True

    async def run(self) -> None:
        server = self.server
        while not server._closing:
            if not self.buf:  # idle between requests: shutdown, keepalive_timeout or a
                # newcomer at the connection cap end it
                with anyio.move_on_after(server.keepalive_timeout) as idle:
                    server._slots.idle(self, idle)
                    try:
                        if server._closing or not await self._fill():
                            return
                    finally:
                        server._slots.busy(self)
                if idle.cancelled_caught:
                    return
            head = await self._await_head()
            if head is None:
                return
            server._begin()
            try:
                if not await self._one(head):
                    return
            finally:
                server._end()

    async def _await_head(self) -> bytes | None:
        """The next request's head, read within ``head_timeout``; None when the
        connection must close. Until the head is complete the connection counts as idle:
        a newcomer at the connection cap may close it (the longest waiting first)."""
        server = self.server
        deadline = anyio.current_time() + server.head_timeout
        head: bytes | None = None
        error: HTTPError | None = None
        with anyio.CancelScope(deadline=deadline) as waiting:
            server._slots.idle(self, waiting)
            try:
                head = await self._read_head()
            except HTTPError as e:
                error = e
            finally:
                server._slots.busy(self)
        if waiting.cancelled_caught:
            if anyio.current_time() >= deadline:  # not closed to make room: too slow
                error = HTTPError(
                    408,
                    f"the request head took over {server.head_timeout:g} s to arrive",
                    type="RequestTimeout",
                )
            else:
                return None
        if error is not None:
            with anyio.move_on_after(1.0):
                await self._send_response(error.to_response(), False, "GET")
            if error.status != 408:
                await self._drain()
            return None
        return head

    async def _one(self, head: bytes) -> bool:
        """Read the body of the request whose ``head`` was read and answer it; False
        when the connection must close."""
        server = self.server
        try:
            with anyio.fail_after(server.request_timeout):
                request = await self._read_request(head)
        except TimeoutError:
            await self._send_response(
                HTTPError(408, "the request took too long to arrive").to_response(), False, "GET"
            )
            return False
        except HTTPError as e:  # refused before its body was read: answer, then close
            await self._send_response(e.to_response(), False, "GET")
            await self._drain()
            return False
        if request is None:
            return False
        keep = _keep_alive(request) and not server._closing and not self.probe_only
        response: Response | StreamingResponse | None
        try:
            route = server.router.resolve(request.method, request.path)
            if self.probe_only and not route.probe:
                raise HTTPError(
                    503,
                    f"the server holds its maximum of {server.max_connections} connections; "
                    "retry shortly",
                    type="ServiceUnavailable",
                    headers=[("retry-after", "1")],
                )
            if route.long_poll:
                response = await self._long_poll(route.handler, request)
            else:
                response = await route.handler(request)
        except HTTPError as e:
            response = e.to_response()
        except Exception as e:
            log.exception("handler for %s %s failed", request.method, request.path)
            response = HTTPError(
                500, f"internal error: {type(e).__name__}: {e}", type="InternalError"
            ).to_response()
        if response is None or self.gone:  # the client left while the handler ran
            if isinstance(response, Response):
                await _undelivered(response)
            return False
        keep = keep and not server._closing
        if isinstance(response, StreamingResponse):
            return await self._send_stream(response, keep, request)
        return await self._send_response(response, keep, request.method, request.http_version)

    async def _read_head(self) -> bytes | None:
        server = self.server
        buf = self.buf
        while buf[:2] == b"\r\n":  # stray CRLF between requests (RFC 9112 2.2)
            del buf[:2]
        start = 0
        while (end := buf.find(b"\r\n\r\n", start)) < 0:
            if len(buf) > server.max_header_bytes:
                break
            start = max(0, len(buf) - 3)
            if not await self._fill():
                return None
        if end < 0 or end > server.max_header_bytes:
            raise HTTPError(
                431,
                f"the request head is over {server.max_header_bytes} bytes",
                type="RequestHeaderFieldsTooLarge",
            )
        head = bytes(buf[:end])
        del buf[: end + 4]
        return head

    async def _read_request(self, head: bytes) -> Request | None:
        server = self.server
        method, path, query, version, headers = _parse_head(head)
        if server.guard is not None:
            server.guard(method, path, headers)
        if "transfer-encoding" in headers:
            raise HTTPError(
                411,
                "request bodies with Transfer-Encoding "
                f"({headers['transfer-encoding']!r}) are not supported: send the body "
                "with a Content-Length header",
                type="LengthRequired",
            )
        length = headers.get("content-length")
        n = 0
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                raise HTTPError(400, f"Content-Length must be a decimal integer, got {length!r}")
            n = int(length)
        if n > server.max_body_bytes:
            raise HTTPError(
                413,
                f"the request body is {n} bytes; this server takes at most {server.max_body_bytes}",
                type="ContentTooLarge",
            )
        if n and headers.get("expect", "").lower() == "100-continue":
            await self.stream.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await self._read_body(n)
        if body is None:
            return None
        return Request(method, path, query, headers, body, version, self.client)

    async def _read_body(self, n: int) -> bytes | None:
        buf = self.buf
        if len(buf) >= n:
            with memoryview(buf) as view:
                body = bytes(view[:n])
            del buf[:n]
            return body
        parts = [bytes(buf)]
        got = len(buf)
        buf.clear()
        while got < n:
            try:
                data = await self.stream.receive(min(n - got, 1 << 20))
            except CONNECTION_ERRORS:
                return None
            parts.append(data)
            got += len(data)
        return b"".join(parts)

    async def _drain(self) -> None:
        # After refusing a body, read (and drop) what the client is still sending for a
        # moment, so that it reads our answer instead of a connection reset.
        with anyio.move_on_after(1.0):
            await self.stream.send_eof()
            total = 0
            while total < 4 * self.server.max_body_bytes:
                try:
                    total += len(await self.stream.receive(1 << 20))
                except CONNECTION_ERRORS:
                    return

    async def _long_poll(
        self, handler: Handler, request: Request
    ) -> Response | StreamingResponse | None:
        server = self.server
        result: Response | StreamingResponse | None = None
        error: Exception | None = None
        with anyio.CancelScope() as scope:
            server._polls.add(scope)
            try:
                if server._closing:
                    scope.cancel()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch, scope)
                    try:
                        result = await handler(request)
                    except Exception as e:
                        error = e
                    tg.cancel_scope.cancel()
            finally:
                server._polls.discard(scope)
        if error is not None:
            raise error
        if result is None and not self.gone:
            raise HTTPError(
                503, "the server is shutting down; retry against its successor", type="ShuttingDown"
            )
        return result

    async def _watch(self, scope: anyio.CancelScope) -> None:
        # Runs beside a long-poll handler: end of stream means the client left.
        try:
            data = await self.stream.receive(RECV_BYTES)
        except CONNECTION_ERRORS:
            self.gone = True
            scope.cancel()
            return
        self.buf += data  # the client's next (pipelined) request: keep it

    async def _send_response(
        self, response: Response, keep: bool, method: str, version: str = "HTTP/1.1"
    ) -> bool:
        body = response.body
        try:
            head = _head(
                response.status,
                response.content_type,
                response.headers,
                keep,
                version,
                f"content-length: {len(body)}\r\n",
            )
        except ValueError as e:
            log.error("bad response from a handler: %s", e)
            head = _head(500, "text/plain", [], False, version, "content-length: 0\r\n")
            body, keep = b"", False
        if method == "HEAD" or response.status in (204, 304) or response.status < 200:
            body = b""
        try:
            if len(body) <= 65536:
                await self.stream.send(head + body)
            else:
                await self.stream.send(head)
                await self.stream.send(body)
        except CONNECTION_ERRORS:
            await _undelivered(response)
            return False
        return keep

    async def _send_stream(self, response: StreamingResponse, keep: bool, request: Request) -> bool:
        chunked = request.http_version == "HTTP/1.1"
        keep = keep and chunked  # HTTP/1.0: the body ends when the connection does
        extra = "transfer-encoding: chunked\r\n" if chunked else ""
        try:
            head = _head(
                response.status,
                response.content_type,
                [("cache-control", "no-cache"), *response.headers],
                keep,
                request.http_version,
                extra,
            )
        except ValueError as e:
            log.error("bad response from a handler: %s", e)
            await self._send_response(Response(status=500), False, "GET")
            return False
        iterator = aiter(response.chunks)
        try:
            await self.stream.send(head)
            if request.method == "HEAD":
                return keep
            async for chunk in iterator:
                if not chunk:
                    continue
                if chunked:
                    chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk)
                await self.stream.send(chunk)
            if chunked:
                await self.stream.send(b"0\r\n\r\n")
        except CONNECTION_ERRORS:
            return False
        finally:
            close = getattr(iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
        return keep


async def _undelivered(response: Response) -> None:
    if response.on_undelivered is None:
        return
    try:
        with anyio.CancelScope(shield=True):
            await response.on_undelivered()
    except Exception:
        log.exception("on_undelivered callback failed")


def _keep_alive(request: Request) -> bool:
    tokens = request.headers.get("connection", "").lower()
    if request.http_version == "HTTP/1.1":
        return "close" not in tokens
    return "keep-alive" in tokens


def _parse_head(
    head: bytes,
) -> tuple[str, str, dict[str, str], str, dict[str, str]]:
    try:
        text = head.decode("latin-1")
        line, *lines = text.split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise HTTPError(400, "malformed request line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HTTPError(
            505 if version.startswith("HTTP/") else 400,
            f"unsupported protocol {version[:20]!r}; this server speaks HTTP/1.1",
        )
    if not method.isalpha() or not method.isupper() or not target:
        raise HTTPError(400, f"malformed request line {line[:100]!r}")
    raw_path, _, raw_query = target.partition("?")
    if not raw_path.startswith("/"):
        raise HTTPError(400, f"request target must be an absolute path, got {target[:100]!r}")
    path = unquote(raw_path) if "%" in raw_path else raw_path
    query = dict(parse_qsl(raw_query, keep_blank_values=True)) if raw_query else {}
    headers: dict[str, str] = {}
    for raw in lines:
        name, sep, value = raw.partition(":")
        if not sep or not name or name != name.strip() or not name.isprintable():
            raise HTTPError(400, f"malformed header line {raw[:100]!r}")
        key = name.lower()
        value = value.strip(" \t")
        if key in headers:
            if key == "content-length" and headers[key] != value:
                raise HTTPError(400, "conflicting Content-Length headers")
            if key != "content-length":
                headers[key] += ", " + value
        else:
            headers[key] = value
    return method, path, query, version, headers


def _head(
    status: int,
    content_type: str,
    headers: list[tuple[str, str]],
    keep: bool,
    version: str,
    extra: str,
) -> bytes:
    parts = [f"HTTP/1.1 {status} {_phrase(status)}\r\ncontent-type: {content_type}\r\n{extra}"]
    if not keep:
        parts.append("connection: close\r\n")
    elif version == "HTTP/1.0":
        parts.append("connection: keep-alive\r\n")
    for name, value in headers:
        _check_header(name, value)
        parts.append(f"{name}: {value}\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1")
