"""MCP servers as tools: the tools of a Model Context Protocol server, offered to the model.

An :class:`MCPServer` is a command spoken to over stdio or a streamable-HTTP URL; each
tool it lists becomes an :class:`MCPTool` whose calls go through the ``mcp`` client under
``timeout_s``. A failed call is a tool error for that call, and a server that died or
hung is restarted for the next one. ``mcp`` is imported only when a server starts
(``pip install 'agentenv[mcp]'``). See docs/guide.md ("MCP servers as tools")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from agentenv._errors import ClosedResourceError, ConfigError, ToolCallError, positive
from agentenv._rewards import State
from agentenv._tools import TOOL_NAME, Tool

if TYPE_CHECKING:
    import mcp
    import mcp.types

__all__ = ["MCPServer", "MCPTool"]

log = logging.getLogger("agentenv.mcp")

# Pages of ``tools/list`` read from one server: a server whose cursor never ends cannot
# hang the start of an episode.
MAX_TOOL_PAGES = 100

_INSTALL_HINT = "install it with pip install 'agentenv[mcp]'"


def _import_mcp() -> Any:
    try:
        import mcp
    except ImportError as e:
        raise ConfigError(f"MCPServer needs the mcp package ({e}); {_INSTALL_HINT}") from None
    return mcp


class MCPTool(Tool):
    """One tool of an MCP server, as :class:`MCPServer` offers it (see :attr:`MCPServer.tools`).

    Its :attr:`parameters` are the server's input schema; arguments are checked against it
    here (JSON Schema), so a bad call is answered without a round trip. :meth:`call` runs
    the tool on the server and returns its text content.

    Attributes:
        remote_name: the tool's name on the server (``name`` is ``prefix + remote_name``).
    """

    def __init__(
        self,
        handle: _Handle,
        remote_name: str,
        name: str,
        description: str,
        parameters: dict[str, Any],
        validator: Any,
    ) -> None:
        # Tool's own __init__ builds the schema from a function's type hints; an MCP tool's
        # schema is the server's, so the attributes the SDK reads are set here instead.
        self._handle = handle
        self._validator = validator
        self.remote_name = remote_name
        self.fn = self._call_remote
        self.name = name
        self.description = description
        self.parameters = parameters
        self.episode_parameters = {}
        self.timeout_s = handle.server.timeout_s
        self.is_async = True

    def _checked(self, arguments: dict[str, Any]) -> dict[str, Any]:
        # Against the server's schema (JSON Schema): the first five problems.
        problems = sorted(self._validator.iter_errors(arguments), key=lambda e: e.path)
        if problems:
            raise self._invalid((e.path, e.message) for e in problems[:5])
        return arguments

    async def call(self, arguments: Any, state: State | None = None) -> str:
        """Validate, run on the server under the server's ``timeout_s``, and return text.

        Raises:
            ToolCallError: the arguments fail the schema, the tool reported an error, or
                the server died, hung or broke the connection (it is restarted for the
                next call).
        """
        return await self._call_remote(**self.validate(arguments))

    async def _call_remote(self, **arguments: Any) -> str:
        return await self._handle.call(self.remote_name, self.name, arguments)

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r}, server={self._handle.server.label!r})"


class MCPServer:
    """An MCP server whose tools the model may call.

    Give exactly one of ``command`` or ``url``. A :class:`~agentenv.ToolEnv` offers its
    tools (``mcp_servers = (server,)``); other code opens them with ``async with
    server.open() as tools``, or holds the server for a run (``async with server:``) and
    reads :attr:`tools`. One process serves every episode at once, from the first to the
    last, unless ``per_episode`` (lifetime and failures: docs/guide.md).

    Args:
        command: the stdio server's program and arguments, e.g. ``["python", "server.py"]``.
        url: a streamable-HTTP server's URL (reconnected, not restarted, after a failure).
        env: environment variables of the subprocess, over a minimal inherited set
            (``HOME``, ``PATH``, ``SHELL``, ``TERM``, ``USER``, ``LOGNAME``).
        cwd: the subprocess's working directory (default: this process's).
        per_episode: a fresh subprocess per episode (stdio servers only).
        prefix: prepended to every tool name the model sees (two servers, or a server and
            a local ``@tool``, offering the same name are refused otherwise).
        timeout_s: wall-clock limit of one tool call; an overrun is a tool error and the
            server is restarted.
        start_timeout_s: wall-clock limit on starting (or reaching) the server and reading
            its tool list.
    """

    def __init__(
        self,
        command: Sequence[str] | None = None,
        *,
        url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        per_episode: bool = False,
        prefix: str = "",
        timeout_s: float = 30.0,
        start_timeout_s: float = 60.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ConfigError(
                "MCPServer needs exactly one of command (a stdio server, e.g. "
                "MCPServer(['python', 'server.py'])) or url (a streamable-HTTP server, e.g. "
                f"MCPServer(url='http://127.0.0.1:8000/mcp')), got command={command!r}, url={url!r}"
            )
        if command is not None:
            if isinstance(command, str) or not all(isinstance(c, str) for c in command):
                raise ConfigError(
                    f"MCPServer command must be a list of strings (program, then arguments), "
                    f"got {command!r}; write MCPServer(['python', 'server.py'])"
                )
            if not command:
                raise ConfigError("MCPServer command is empty; give the program to start")
        if url is not None and not re.match(r"https?://", url):
            raise ConfigError(
                f"MCPServer url must be an http:// or https:// URL, got {url!r}; a stdio "
                "server is given as command=[...]"
            )
        if url is not None and (env is not None or cwd is not None or per_episode):
            raise ConfigError(
                "env, cwd and per_episode apply to a server this process starts (command=...); "
                f"the server at {url!r} runs elsewhere"
            )
        if prefix and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", prefix):
            raise ConfigError(
                f"MCPServer prefix must start with a letter or _ and hold only letters, "
                f"digits, _ . -, got {prefix!r}"
            )
        self.command: tuple[str, ...] | None = tuple(command) if command is not None else None
        self.url = url
        self.env: dict[str, str] | None = dict(env) if env is not None else None
        self.cwd = os.fspath(cwd) if cwd is not None else None
        self.per_episode = per_episode
        self.prefix = prefix
        self.timeout_s = positive("MCPServer timeout_s", timeout_s)
        self.start_timeout_s = positive("MCPServer start_timeout_s", start_timeout_s)
        self._warned: set[str] = set()
        # The shared server of this event loop (a class-level server outlives a run).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._users = 0
        self._shared: _Handle | None = None

    @property
    def label(self) -> str:
        """The server as errors and warnings name it."""
        return self.url if self.url is not None else " ".join(self.command or ())

    def __repr__(self) -> str:
        where = (
            f"url={self.url!r}" if self.url is not None else f"command={list(self.command or ())!r}"
        )
        return f"MCPServer({where})"

    # -- use -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def open(self) -> AsyncIterator[tuple[MCPTool, ...]]:
        """The server's tools, for one episode: a fresh server with ``per_episode``, else
        the shared one (started by its first user, stopped after its last).

        Raises:
            ConfigError: the server could not be started or reached, or its tool list
                read, within ``start_timeout_s`` (the message says why).
        """
        if self.per_episode:
            handle = _Handle(self)
            try:
                await handle.start()
                yield handle.tools
            finally:
                await handle.aclose()
            return
        handle = await self._acquire()
        try:
            yield handle.tools
        finally:
            await self._release()

    @property
    def tools(self) -> tuple[MCPTool, ...]:
        """The tools of the shared server, while ``async with server:`` holds it.

        Raises:
            ClosedResourceError: the server is not held open.
        """
        if self._shared is None or self._loop is not _running_loop():
            raise ClosedResourceError(
                f"MCPServer {self.label!r} is not open; use `async with server:` (or "
                "`async with server.open() as tools:`) before reading its tools"
            )
        return self._shared.tools

    async def __aenter__(self) -> MCPServer:
        await self._acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._release()

    # -- the shared server's lifetime ------------------------------------------------------
    def _state_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:  # a new event loop (a new run)
            self._lock, self._loop = asyncio.Lock(), loop
            self._users, self._shared = 0, None
        return self._lock

    async def _acquire(self) -> _Handle:
        async with self._state_lock():
            if self._shared is None:
                handle = _Handle(self)
                await handle.start()
                self._shared = handle
            self._users += 1
            return self._shared

    async def _release(self) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled episode still stops the server
            async with self._state_lock():
                self._users -= 1
                if self._users == 0 and self._shared is not None:
                    handle, self._shared = self._shared, None
                    await handle.aclose()

    def _warn_once(self, tool_name: str, why: str) -> None:
        if tool_name in self._warned:
            return
        self._warned.add(tool_name)
        log.warning("MCP server %s: tool %r skipped: %s", self.label, tool_name, why)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclasses.dataclass(eq=False)
class _Connection:
    """One started server process (or HTTP session), owned by its own task.

    The ``mcp`` client is an anyio context whose task group must be entered and left by the
    same task; episodes come and go in other tasks, so a dedicated task holds it open
    until :attr:`stop` is set.
    """

    client: mcp.Client
    listing: list[mcp.types.Tool]
    stop: asyncio.Event
    task: asyncio.Task[None]
    broken: str | None = None


class _Handle:
    """A server's tools and the connection they call through, restarted after a failure."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.tools: tuple[MCPTool, ...] = ()
        self._conn: _Connection | None = None
        self._retired: list[_Connection] = []
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        conn = await self._connect()
        self._conn = conn
        try:
            self.tools = self._build_tools(conn.listing)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):  # never leave a server process behind
            self._closed = True
            conns = [*self._retired, *([self._conn] if self._conn is not None else [])]
            self._conn, self._retired = None, []
            for conn in conns:
                conn.stop.set()
            for conn in conns:
                with contextlib.suppress(BaseException):
                    await conn.task

    async def call(self, remote_name: str, name: str, arguments: dict[str, Any]) -> str:
        label = self.server.label
        conn = await self._current(name)
        try:
            with anyio.fail_after(self.server.timeout_s):
                result = await conn.client.call_tool(remote_name, arguments)
        except TimeoutError:
            self._retire(conn, "timed out")
            raise ToolCallError(
                f"tool {name!r} timed out after {self.server.timeout_s} s (MCP server {label}; "
                "restarted for the next call)"
            ) from None
        except Exception as e:
            from mcp import MCPError
            from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

            if isinstance(e, MCPError) and e.code not in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
                # The server answered with a protocol error: it is alive.
                raise ToolCallError(f"MCP server {label} refused {name!r}: {e}") from None
            self._retire(conn, str(e) or type(e).__name__)
            raise ToolCallError(
                f"tool {name!r} failed: the MCP server {label} broke the connection "
                f"({type(e).__name__}: {e}); it is restarted for the next call"
            ) from None
        text = _result_text(result)
        if result.is_error:
            raise ToolCallError(f"tool {name!r} reported an error: {text}")
        return text

    async def _current(self, name: str) -> _Connection:
        async with self._lock:
            if self._closed:
                raise ToolCallError(f"tool {name!r} called after its MCP server was closed")
            conn = self._conn
            if conn is not None and conn.broken is None and not conn.task.done():
                return conn
            if conn is not None:
                self._retire(conn, conn.broken or "stopped")
            try:
                conn = await self._connect()
            except ConfigError as e:
                raise ToolCallError(f"tool {name!r} unavailable: {e}") from None
            self._conn = conn
            return conn

    def _retire(self, conn: _Connection, why: str) -> None:
        # A failed call's server is replaced for the next call; stopping it (up to a few
        # seconds for a hung process) runs in its own task, not in the failed call.
        if conn.broken is None:
            conn.broken = why
            log.warning(
                "MCP server %s: restarting after a failed call (%s)", self.server.label, why
            )
        if conn is self._conn:
            self._conn = None
            self._retired.append(conn)
        conn.stop.set()
        self._retired = [c for c in self._retired if not c.task.done()]

    async def _connect(self) -> _Connection:
        sdk = _import_mcp()
        server = self.server
        command = server.command or ()
        params = None
        if server.url is None:
            params = sdk.StdioServerParameters(
                command=command[0], args=list(command[1:]), env=server.env, cwd=server.cwd
            )
        ready: asyncio.Future[tuple[mcp.Client, list[mcp.types.Tool]]]
        ready = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        # The deadline of the start; lifted once the tool list is read. The scope encloses
        # the client's whole context, as anyio's nesting of scopes requires.
        scope = anyio.CancelScope(deadline=anyio.current_time() + server.start_timeout_s)

        async def own() -> None:
            try:
                with scope, contextlib.ExitStack() as files:
                    target: Any = server.url
                    if params is not None:
                        errlog = _stderr_for_subprocess(files)
                        target = sdk.stdio_client(params, errlog=errlog)
                    async with sdk.Client(target) as client:
                        listing = await _list_tools(client)
                        scope.deadline = math.inf
                        ready.set_result((client, listing))
                        await stop.wait()
                if not ready.done():
                    ready.set_exception(
                        TimeoutError(f"no answer within start_timeout_s={server.start_timeout_s}")
                    )
            except BaseException as e:
                if not ready.done():
                    ready.set_exception(e)
                if not isinstance(e, Exception):
                    raise
                # After the start, a server's failure reaches the calls that were using it.
                log.debug("MCP server %s stopped: %r", server.label, e)

        task = asyncio.create_task(own(), name=f"agentenv MCP server {server.label}")
        try:
            client, listing = await ready
        except Exception as e:
            with contextlib.suppress(BaseException):
                await task
            how = (
                "check that the server runs at that URL"
                if server.url is not None
                else "check that the command starts an MCP server on stdio (run it by hand: "
                "it should wait for input), or raise start_timeout_s"
            )
            cause: BaseException = e
            while isinstance(cause, BaseExceptionGroup):  # anyio's task groups wrap it
                cause = cause.exceptions[0]
            verb = "reached" if server.url is not None else "started"
            raise ConfigError(
                f"MCP server {server.label} could not be {verb}: "
                f"{type(cause).__name__}: {cause}; {how}"
            ) from None
        except BaseException:
            stop.set()
            scope.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(BaseException):
                await task
            raise
        return _Connection(client, listing, stop, task)

    def _build_tools(self, listing: Sequence[mcp.types.Tool]) -> tuple[MCPTool, ...]:
        import jsonschema

        server = self.server
        tools: list[MCPTool] = []
        seen: set[str] = set()
        for remote in listing:
            name = server.prefix + remote.name
            schema = remote.input_schema
            why = None
            if not TOOL_NAME.fullmatch(name):
                why = (
                    "its name must be at most 64 letters, digits, _ . - (not starting with a digit)"
                )
            elif name in seen:
                why = "the server lists it twice"
            elif not isinstance(schema, dict) or schema.get("type") != "object":
                why = (
                    "its input schema must be a JSON object schema ({'type': 'object', ...}), "
                    f"got type {schema.get('type')!r}"
                )
            else:
                cls = jsonschema.validators.validator_for(schema)
                try:
                    cls.check_schema(schema)
                except jsonschema.SchemaError as e:
                    why = f"its input schema is not valid JSON Schema ({e.message})"
            if why is not None:
                server._warn_once(remote.name, why)
                continue
            seen.add(name)
            parameters = json.loads(json.dumps(schema))  # ours: the server's object is not
            parameters.setdefault("properties", {})
            tools.append(
                MCPTool(
                    self,
                    remote.name,
                    name,
                    remote.description or "",
                    parameters,
                    cls(parameters),
                )
            )
        return tuple(tools)


def _stderr_for_subprocess(files: contextlib.ExitStack) -> TextIO:
    """Where a stdio server's stderr goes: ours, when it is a file (a notebook's or a
    capturing test's ``sys.stderr`` is not, and a subprocess needs a file descriptor),
    else the process's own stderr, else nowhere."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.fileno()
                return stream
        except (OSError, ValueError):  # io.UnsupportedOperation is both
            continue
    return files.enter_context(open(os.devnull, "w"))  # closed when the server stops


async def _list_tools(client: mcp.Client) -> list[mcp.types.Tool]:
    listing: list[mcp.types.Tool] = []
    cursor: str | None = None
    for _ in range(MAX_TOOL_PAGES):
        page = await client.list_tools(cursor=cursor)
        listing.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return listing
    raise ConfigError(
        f"the server's tools/list did not end after {MAX_TOOL_PAGES} pages (MAX_TOOL_PAGES)"
    )


def _result_text(result: mcp.types.CallToolResult) -> str:
    """The text of a tool result; other content is named, not passed on (the model reads text)."""
    from mcp.types import EmbeddedResource, ResourceLink, TextContent, TextResourceContents

    parts: list[str] = []
    for block in result.content:
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, EmbeddedResource) and isinstance(
            block.resource, TextResourceContents
        ):
            parts.append(block.resource.text)
        elif isinstance(block, ResourceLink):
            parts.append(f"[resource link: {block.uri}]")
        else:
            inner = block.resource if isinstance(block, EmbeddedResource) else block
            mime = getattr(inner, "mime_type", None)
            kind = f"{block.type} content" + (f" ({mime})" if mime else "")
            parts.append(f"[{kind} omitted: tools give the model text only]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)
