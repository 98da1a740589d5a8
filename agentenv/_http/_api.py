"""agentenv's handler API: a :class:`Router` from ``(method, path)`` to
``async def handler(request: Request) -> Response | StreamingResponse``, and the errors a
handler raises (:class:`HTTPError`). :class:`~agentenv.http.HTTPServer` serves it."""

from __future__ import annotations

import dataclasses
import http
import json
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from typing import Any

from agentenv._errors import AgentEnvError, ConfigError

__all__ = [
    "MAX_JSON_DEPTH",
    "Guard",
    "HTTPError",
    "Handler",
    "Request",
    "Response",
    "Router",
    "StreamingResponse",
    "decode_json",
    "sse",
]


class HTTPError(AgentEnvError):
    """Raise in a handler to answer ``status`` with ``{"error": {"type", "message"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        headers: list[tuple[str, str]] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _PHRASES.get(status, "").replace(" ", "")
        self.headers = headers or []
        self.code = code  # a machine-readable reason (OpenAI's ``code``), when there is one

    def to_response(self) -> Response:
        error = {"type": self.type, "message": self.message}
        if self.code is not None:
            error["code"] = self.code
        return Response.json({"error": error}, status=self.status, headers=self.headers)


MAX_JSON_DEPTH = 128
"""Arrays and objects nested in a request body, at most. Code that walks a decoded body
recursively (schema checks, chat templates, ``json.dumps``) fails near Python's recursion
limit (~1,000 frames, shared with the caller's), so deeper bodies are refused up front;
real bodies (JSON Schemas of tools included) nest a few dozen levels at most."""


def decode_json(body: bytes | str) -> Any:
    """``body`` decoded; ValueError naming the problem when it is not JSON or nests
    deeper than :data:`MAX_JSON_DEPTH` (never RecursionError)."""
    try:
        data = json.loads(body)
    except RecursionError:  # the C decoder's own guard, deep below any usable depth
        raise ValueError(_TOO_DEEP) from None
    # Nesting needs brackets: a body with fewer than the bound cannot exceed it, and
    # counting them (C speed) spares most bodies the walk.
    raw = body.encode() if isinstance(body, str) else body
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_JSON_DEPTH and _deeper_than(data, MAX_JSON_DEPTH):
        raise ValueError(_TOO_DEEP)
    return data


_TOO_DEEP = (
    f"it nests arrays and objects deeper than {MAX_JSON_DEPTH} levels, the most this server "
    "takes; send a flatter body"
)


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether ``data`` nests containers more than ``limit`` deep (a level-by-level walk,
    no recursion)."""
    level = [data] if isinstance(data, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for item in level:
            values = item.values() if isinstance(item, dict) else item
            below.extend(v for v in values if isinstance(v, dict | list))
        level = below
    return False


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
        """The body as JSON; :class:`HTTPError` 400 when it is not, or when it nests
        deeper than :data:`MAX_JSON_DEPTH`."""
        try:
            return decode_json(self.body)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too deep
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


ErrorShape = Callable[[HTTPError], Response]
"""``shape(error)``: a refusal as a route's clients expect it (e.g. Anthropic's error body);
the server's own refusals of a request (too large, too slow, too many) go through it too."""


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
    errors: ErrorShape | None = None


class Router:
    """Handlers by ``(method, path)``; unknown paths answer 404, wrong methods 405.

    A path segment written ``{name}`` matches any one non-empty segment
    (``/e/{key}/v1/models`` serves ``/e/abc/v1/models``); the handler reads it from
    ``request.path``. Exact paths are looked up first.
    """

    def __init__(self) -> None:
        self._routes: dict[tuple[str, str], _Route] = {}
        self._methods: dict[str, list[str]] = {}
        # Patterns by segment count: (segments, None where any segment matches).
        self._patterns: dict[int, list[tuple[str, tuple[str | None, ...]]]] = {}

    def add(
        self,
        method: str,
        path: str,
        handler: Handler,
        *,
        long_poll: bool = False,
        probe: bool = False,
        errors: ErrorShape | None = None,
    ) -> None:
        """Route ``method path`` to ``handler``.

        ``long_poll=True`` for handlers that may wait long (for data, for room): they are
        cancelled when the client disconnects, and answer 503 when the server shuts down.
        ``probe=True`` for a health check: still answered when every connection is busy
        (on the server's reserved connections). ``errors`` shapes every refusal of a
        request to this route, the server's own included (default:
        :meth:`HTTPError.to_response`).
        """
        method = method.upper()
        if not path.startswith("/"):
            raise ConfigError(f"a route path must start with '/', got {path!r}")
        if (method, path) in self._routes:
            raise ConfigError(f"route {method} {path} is already registered")
        self._routes[method, path] = _Route(handler, long_poll, probe, errors)
        if path not in self._methods and "{" in path:
            parts = tuple(
                None if p.startswith("{") and p.endswith("}") else p for p in path.split("/")
            )
            self._patterns.setdefault(len(parts), []).append((path, parts))
        self._methods.setdefault(path, []).append(method)

    def route(
        self, method: str, path: str, *, long_poll: bool = False, probe: bool = False
    ) -> Callable[[Handler], Handler]:
        """Decorator form of :meth:`add`."""

        def register(handler: Handler) -> Handler:
            self.add(method, path, handler, long_poll=long_poll, probe=probe)
            return handler

        return register

    def handlers(self) -> dict[tuple[str, str], Handler]:
        """Every route's handler by ``(method, path)``, as added (to serve them elsewhere)."""
        return {key: route.handler for key, route in self._routes.items()}

    def refusal(self, method: str, path: str, error: HTTPError) -> Response:
        """``error`` as the route of ``method path`` shapes its refusals (the default shape
        when no route matches)."""
        try:
            route = self.resolve(method, path)
        except HTTPError:
            return error.to_response()
        return route.errors(error) if route.errors is not None else error.to_response()

    def resolve(self, method: str, path: str) -> _Route:
        if (method, path) not in self._routes and self._patterns:
            path = self._match(path)
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

    def _match(self, path: str) -> str:
        """The pattern that ``path`` matches (``path`` itself when none does)."""
        parts = path.split("/")
        for pattern, want in self._patterns.get(len(parts), ()):
            if all(w == p if w is not None else bool(p) for w, p in zip(want, parts, strict=True)):
                return pattern
        return path


_PHRASES: dict[int, str] = {s.value: s.phrase for s in http.HTTPStatus}
