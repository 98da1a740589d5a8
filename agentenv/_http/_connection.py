"""One client connection: aiohttp's HTTP/1.1 protocol (``RequestHandler`` parses requests
with llhttp, queues pipelined ones and writes the answers) with what
:class:`~agentenv.http.HTTPServer` promises on top: the connection's place in the
server's :class:`~agentenv._http._limits.Slots` (idle until a request's head is read, so
a newcomer at the cap may close it; busy until it is answered), ``head_timeout`` (408)
and ``max_header_bytes`` (431) for the whole head (aiohttp bounds each line), aiohttp's
refusals of a request's form answered in agentenv's error shape, and long-poll handlers
cancelled when the client goes away.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler

from agentenv._http._api import HTTPError
from agentenv._http._limits import Slots, raw_error

__all__ = ["Connection", "Connections"]

log = logging.getLogger("agentenv.http")


class Connections:
    """A server's open connections and the requests in them: what shutdown waits for."""

    def __init__(self, slots: Slots, *, head_timeout: float, max_header_bytes: int) -> None:
        self.slots = slots
        self.head_timeout = head_timeout
        self.max_header_bytes = max_header_bytes
        self.open: set[Connection] = set()
        self.busy = 0  # requests being handled (head read, not yet answered)
        self.closing = False
        self.quiet = anyio.Event()  # set when closing with no request left
        self.all_closed = anyio.Event()  # set when closing with no connection left

    def close(self) -> None:
        """The server is closing: the events now fire when their condition holds."""
        self.closing = True
        if not self.busy:
            self.quiet.set()
        if not self.open:
            self.all_closed.set()

    def lost(self, conn: Connection) -> None:
        self.open.discard(conn)
        if self.closing and not self.open:
            self.all_closed.set()

    def end(self) -> None:
        self.busy -= 1
        if self.closing and not self.busy:
            self.quiet.set()


class Connection(RequestHandler):
    """aiohttp's protocol for one connection, counted in ``server``."""

    __slots__ = (
        "_body",
        "_head_bytes",
        "_head_timer",
        "busy",
        "gone",
        "polls",
        "probe_only",
        "server",
    )

    def __init__(self, server: Connections, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, loop=asyncio.get_running_loop(), **kwargs)
        self.server = server
        self.busy = False  # from a request's head to its answer
        self.gone = False  # the client disconnected
        self.probe_only = False  # beyond the cap: one request, answered only if a probe
        self.polls: set[anyio.CancelScope] = set()  # its long-poll handlers running
        self._body: StreamReader = EMPTY_PAYLOAD  # the last request's, read or dropped
        self._head_bytes = 0  # of the request head under way
        self._head_timer: asyncio.TimerHandle | None = None

    # -- the connection's life --------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.server.open.add(self)
        self.server.slots.idle(self, self.close_now)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gone = True
        for scope in self.polls:
            scope.cancel()
        self._stop_head_timer()
        self._end_body()
        self.server.slots.leave(self)
        self.server.lost(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Waiting for a head: not in a request, nor in the rest of a refused body.
        # (`_messages`: aiohttp's queue of parsed requests not yet handled; aiohttp is
        # pinned, and tests/agentenv/test_http.py checks the head bounds this serves.)
        waiting = not self.busy and not self._messages and self._body.is_eof()
        if waiting and data:
            if self._head_timer is None:  # a request's first byte: its head is timed now
                self.keep_alive(True)  # (stops aiohttp's idle timer)
                self._head_timer = self._loop.call_later(
                    self.server.head_timeout, self._head_too_slow
                )
                self.server.slots.idle(self, self.close_now)  # idle since its head began
            self._head_bytes += len(data)
        super().data_received(data)
        if waiting and self._head_bytes > self.server.max_header_bytes and not self._messages:
            self.refuse(
                431,
                "RequestHeaderFieldsTooLarge",
                f"the request head is over {self.server.max_header_bytes} bytes",
            )

    def begin(self, body: StreamReader) -> None:
        """A request's head is read: the connection is busy until :meth:`end`."""
        self.busy = True
        self._body = body
        self._stop_head_timer()
        self.server.slots.busy(self)
        self.server.busy += 1

    def end(self) -> None:
        """The request is answered: the connection waits for the next one."""
        if not self.busy:
            return
        self.busy = False
        self._head_bytes = 0
        self.server.end()
        if not self.gone:
            self.server.slots.idle(self, self.close_now)

    def close_now(self) -> None:
        """Close the connection (idle, or sending a head): to make room, or at shutdown."""
        self._end_body()
        self.force_close()

    def _end_body(self) -> None:
        # Ends aiohttp's reading (and dropping) of the rest of a refused body, which
        # would fail on a closed connection.
        if not self._body.is_eof():
            self._body.feed_eof()

    def refuse(self, status: int, type: str, message: str) -> None:
        """Answer ``status`` and close, outside any request handler."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(raw_error(status, type, message))
        self.close_now()

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.busy and not self._messages:
            seconds = self.server.head_timeout
            self.refuse(
                408, "RequestTimeout", f"the request head took over {seconds:g} s to arrive"
            )

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    # -- requests aiohttp's parser refused --------------------------------------------
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        self.end()
        if isinstance(exc, LineTooLong):
            error = HTTPError(
                431,
                f"a request line or header is over {self.server.max_header_bytes} bytes",
                type="RequestHeaderFieldsTooLarge",
            )
        elif isinstance(exc, HttpProcessingError):
            text = (exc.message or type(exc).__name__).split("\n")[0].rstrip(":")
            error = HTTPError(status, f"malformed request: {text}")
        else:
            log.error("HTTP request failed", exc_info=exc)
            error = HTTPError(status, f"internal error: {exc!r}", type="InternalError")
        response = error.to_response()
        out = web.Response(
            body=response.body,
            status=response.status,
            headers=[("content-type", response.content_type)],
        )
        out.force_close()
        return out
