"""How many connections an :class:`~agentenv.http.HTTPServer` holds at once, and what it
does at the cap (docs/inference.md, "Connections", says it for a user).

Every connection costs a file descriptor, and a process that runs out of them can accept
no one: idle sockets alone would lock every client out. So the server counts its
connections against ``max_connections`` (:func:`default_max_connections`). At the cap
the connection waiting the longest (kept alive between requests, silent, or its request
head incomplete) is closed to make room; when every connection is busy (its head read),
``reserve`` more are accepted whose one request is answered only if it is to a probe
route (``Router.add(..., probe=True)``; any other gets 503, ``Retry-After: 1``), and
beyond those a connection gets 503 at once. If ``accept`` fails for want of descriptors
anyway (``EMFILE``), a spare descriptor held for the purpose is given up for a moment to
accept the client and tell it 503, so it is not left waiting in the backlog.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import http
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from agentenv._errors import ConfigError
from agentenv._http._api import HTTPError

__all__ = [
    "DEFAULT_RESERVE",
    "MAX_BODY_BYTES",
    "ClientLimit",
    "Slots",
    "default_max_connections",
    "open_file_limit",
    "raise_open_file_limit",
]

log = logging.getLogger("agentenv.http")

DEFAULT_RESERVE = 8  # connections beyond the cap, for health probes
MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body, at most, unless the server says otherwise
_MAX_DEFAULT = 8192  # a default cap above this buys little and costs memory per connection

Admission = Literal["serve", "probe", "refuse"]


def open_file_limit() -> int:
    """This process's soft limit on open file descriptors (``ulimit -n``)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 1024
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_file_limit(target: int = 65536) -> int:
    """Raise the soft descriptor limit to ``target`` or the hard limit, whichever is lower
    (as SGLang's server does at start); returns the soft limit now in force."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return open_file_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return open_file_limit()


def default_max_connections(limit: int | None = None) -> int:
    """The connection cap for a descriptor limit (default: this process's): three quarters
    of what is left after 64 for files, pipes and libraries; between 16 and 8,192."""
    soft = open_file_limit() if limit is None else limit
    return max(16, min(_MAX_DEFAULT, (soft - 64) * 3 // 4))


@dataclasses.dataclass(frozen=True, slots=True)
class ClientLimit:
    """At most ``max_requests`` requests of one client in flight at once (from its head
    to its answer, body included), so one client cannot take every connection.

    ``client(method, path, headers)`` names a request's client from its head (``None``:
    not counted), or raises :class:`~agentenv.http.HTTPError` to refuse the request
    unread. A request beyond the limit is answered 429 before its body is read, and its
    connection is closed; ``hint`` (in that answer) says how to raise the limit.
    """

    client: Callable[[str, str, Mapping[str, str]], str | None]
    max_requests: int
    hint: str = ""


class InFlight:
    """Requests in flight per client, against a :class:`ClientLimit`."""

    def __init__(self, limit: ClientLimit) -> None:
        if limit.max_requests < 1:
            raise ConfigError(
                f"max_requests per client must be at least 1, got {limit.max_requests}"
            )
        self.limit = limit
        self.counts: dict[str, int] = {}

    def take(self, method: str, path: str, headers: Mapping[str, str]) -> str | None:
        """Count a request whose head is read: its client (give it back with
        :meth:`give`), or None when not counted; HTTPError 429 beyond the limit."""
        client = self.limit.client(method, path, headers)
        if client is None:
            return None
        n = self.counts.get(client, 0)
        if n >= self.limit.max_requests:
            hint = f"; {self.limit.hint}" if self.limit.hint else ""
            raise HTTPError(
                429,
                f"this client already has {n} requests in flight, the most one client may "
                f"have at once; wait for their answers before sending more{hint}",
                type="TooManyRequests",
                headers=[("retry-after", "1")],
            )
        self.counts[client] = n + 1
        return client

    def give(self, client: str) -> None:
        n = self.counts.pop(client, 0) - 1
        if n > 0:
            self.counts[client] = n


def raw_error(
    status: int, type: str, message: str, headers: Iterable[tuple[str, str]] = ()
) -> bytes:
    """A whole error answer in agentenv's shape, ending the connection: written straight
    to a socket the request handler never got to (refused, or its head never came)."""
    body = json.dumps({"error": {"type": type, "message": message}}).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class Slots:
    """The server's connections, counted against ``cap`` (plus ``reserve`` for probes),
    and which of them are idle (no request, or its head incomplete), the longest first."""

    def __init__(self, cap: int, reserve: int) -> None:
        self.cap = cap
        self.reserve = reserve
        self._open: set[object] = set()
        self._idle: dict[object, Callable[[], None]] = {}  # insertion order: idle since
        self._spare: int | None = None
        self._warned = 0.0
        self._refused = 0

    @property
    def open(self) -> int:
        """Connections counted now."""
        return len(self._open)

    def admit(self, conn: object) -> Admission:
        """Count a new connection: served, kept for a probe, or refused (not counted)."""
        if len(self._open) >= self.cap:
            self._evict_idle()
        if len(self._open) < self.cap:
            self._open.add(conn)
            return "serve"
        if len(self._open) < self.cap + self.reserve:
            self._open.add(conn)
            return "probe"
        self._note_refusal()
        return "refuse"

    def leave(self, conn: object) -> None:
        """``conn`` closed (or is closing)."""
        self._open.discard(conn)
        self._idle.pop(conn, None)

    def idle(self, conn: object, close: Callable[[], None]) -> None:
        """``conn`` waits for a request or its head (idle since now); ``close()`` closes it."""
        self._idle.pop(conn, None)
        self._idle[conn] = close

    def busy(self, conn: object) -> None:
        """``conn`` got a request head (or stopped waiting)."""
        self._idle.pop(conn, None)

    def close_idle(self) -> None:
        """Close every idle connection (shutdown)."""
        for close in list(self._idle.values()):
            close()
        self._idle.clear()

    def _evict_idle(self) -> None:
        if not self._idle:
            return
        conn = next(iter(self._idle))
        close = self._idle.pop(conn)
        self._open.discard(conn)
        close()

    # -- running out of descriptors -----------------------------------------------------
    def hold_spare(self) -> None:
        """Keep one descriptor in hand for :meth:`refuse_with_spare`."""
        if self._spare is None:
            with contextlib.suppress(OSError):
                self._spare = os.open(os.devnull, os.O_RDONLY)

    def release_spare(self) -> None:
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    def refuse_with_spare(self, sock: socket.socket, error: OSError) -> bool:
        """After ``accept`` failed with ``error``: if it was for want of descriptors, give up
        the spare one to accept the client and answer it 503. False if nothing was done."""
        if error.errno not in (errno.EMFILE, errno.ENFILE) or self._spare is None:
            return False
        self.release_spare()
        try:
            client, _ = sock.accept()
        except OSError:
            return False
        finally:
            self.hold_spare()
        self.refuse(client)
        self._note_refusal(f"out of file descriptors ({error.strerror})")
        return True

    def refuse(self, client: socket.socket) -> None:
        """Answer ``client`` 503 and close it, without waiting."""
        try:
            client.setblocking(False)
            busy = f"the server holds its maximum of {self.cap} connections; retry shortly"
            client.send(raw_error(503, "ServiceUnavailable", busy, [("retry-after", "1")]))
            client.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            client.close()

    def _note_refusal(self, why: str | None = None) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._warned >= 10.0:  # a warning every 10 s at most, with the count
            self._warned = now
            log.warning(
                "refused %d connection(s) with 503: %s",
                self._refused,
                why or f"all {self.cap} connections (+{self.reserve} for probes) are busy",
            )
            self._refused = 0
