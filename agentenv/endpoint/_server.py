"""The loopback server behind every episode's OpenAI-compatible endpoint.

One :class:`AgentServer` serves a run's episodes on 127.0.0.1, each at a path with a key
nobody else holds (``http://127.0.0.1:PORT/e/<key>/v1``), while an episode holds one::

    async with server.open(episode) as endpoint:
        client = endpoint.client()           # an openai.AsyncOpenAI
        await my_agent(client)               # POST {endpoint.base_url}/chat/completions
        claude = endpoint.anthropic_client() # an anthropic.AsyncAnthropic: POST .../v1/messages

:func:`chat_routes` adds the same routes, without episodes, to another server's router
(``agentenv serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import anyio
import httpx

from agentenv._environment import Episode, Limits, Task
from agentenv._errors import ConfigError, at_least, positive
from agentenv._generator import Generator, SamplingParams
from agentenv._http import (
    AiohttpTransport,
    ClientLimit,
    ErrorShape,
    HTTPError,
    Request,
    Response,
    Router,
    StreamingResponse,
)
from agentenv._sample import Status
from agentenv._tokenizer import Tokenizer
from agentenv._tools import ToolCallParser
from agentenv.endpoint._anthropic import (
    anthropic_error,
    anthropic_refusal,
    message_body,
    message_events,
    parse_count_tokens,
    parse_messages,
)
from agentenv.endpoint._protocol import (
    ChatCall,
    ChatError,
    ChatReply,
    completion_body,
    models_body,
    parse_chat,
    stream_chunks,
)
from agentenv.endpoint._recorder import EpisodeRecorder
from agentenv.endpoint._responses import parse_responses, response_body, response_events

__all__ = [
    "BODY_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "MAX_REQUESTS_PER_ENDPOINT",
    "AgentServer",
    "Endpoint",
    "chat_routes",
    "serve_chat",
]

_PREFIX = "/e/"

# The endpoints' bounds (AgentServer's and AgentEnv's defaults). A body holds the whole
# conversation, so its cap is generous (a 1M-token conversation is ~4 MB of text); its
# messages are refused before they are tokenized when they cannot fit the context anyway
# (see Transcript).
MAX_BODY_BYTES = 16 * 1024 * 1024
BODY_TIMEOUT_S = 10.0  # an agent on this machine sends a body in milliseconds
MAX_REQUESTS_PER_ENDPOINT = 64  # calls of one episode (one role) in flight at once


@dataclasses.dataclass(frozen=True, slots=True)
class _API:
    """One wire format: how a request becomes a call, and a reply an answer."""

    parse: Callable[[Any], ChatCall]
    body: Callable[[ChatCall, ChatReply, str, str], dict[str, Any]]
    stream: Callable[[ChatCall, ChatReply, str, str], Iterable[bytes]]
    prefix: str
    error: Callable[[ChatError], Response] = ChatError.to_response
    refusal: ErrorShape | None = None  # the HTTP layer's refusals (default: its own shape)


_CHAT = _API(parse_chat, completion_body, stream_chunks, "chatcmpl-")
_RESPONSES = _API(parse_responses, response_body, response_events, "")
_MESSAGES = _API(
    parse_messages, message_body, message_events, "msg_", anthropic_error, anthropic_refusal
)


async def _answer(
    request: Request, recorder: EpisodeRecorder, model: str, api: _API
) -> Response | StreamingResponse:
    """One call through ``recorder``, as a response or an SSE stream."""
    recorder.calls += 1
    try:
        try:
            body = request.json()
        except HTTPError as e:
            raise ChatError(400, e.message) from None
        call = api.parse(body)
        reply = await recorder.complete(call)
    except ChatError as e:
        recorder.refused += 1
        return api.error(e)
    cid = f"{api.prefix}{uuid.uuid4().hex}"
    name = call.model or model
    if call.stream:
        chunks = list(api.stream(call, reply, cid, name))

        async def send() -> AsyncIterator[bytes]:
            for c in chunks:
                yield c

        return StreamingResponse(send())
    return Response.json(api.body(call, reply, cid, name))


def _routes(
    router: Router,
    recorder: Callable[[Request], EpisodeRecorder],
    model: str,
    prefix: str,
    *,
    models_check: bool = False,
) -> None:
    """The routes of :func:`chat_routes`, each call through ``recorder(request)`` (a
    :class:`ChatError` from it is the answer, in the route's shape); ``models_check``:
    ``GET /v1/models`` looks the recorder up too (an ended episode's answers its error)."""

    def route(path: str, api: _API) -> None:
        async def handler(request: Request) -> Response | StreamingResponse:
            try:
                found = recorder(request)
            except ChatError as e:
                return api.error(e)
            return await _answer(request, found, model, api)

        router.add("POST", f"{prefix}/v1/{path}", handler, long_poll=True, errors=api.refusal)

    async def count_tokens(request: Request) -> Response:
        """Anthropic's prompt tokens, nothing generated or recorded (not a call: it is
        not counted in ``recorder.calls``)."""
        try:
            found = recorder(request)
            try:
                body = request.json()
            except HTTPError as e:
                raise ChatError(400, e.message) from None
            n = await found.count_tokens(parse_count_tokens(body))
        except ChatError as e:
            return anthropic_error(e)
        return Response.json({"input_tokens": n})

    async def models(request: Request) -> Response:
        try:
            if models_check:
                recorder(request)
        except ChatError as e:
            return e.to_response()
        return Response.json(models_body([model]))

    route("chat/completions", _CHAT)
    route("responses", _RESPONSES)
    route("messages", _MESSAGES)
    count = f"{prefix}/v1/messages/count_tokens"
    router.add("POST", count, count_tokens, errors=anthropic_refusal)
    router.add("GET", f"{prefix}/v1/models", models)


def chat_routes(
    router: Router,
    recorder: Callable[[], EpisodeRecorder],
    *,
    model: str,
    prefix: str = "",
) -> None:
    """Serve ``POST {prefix}/v1/chat/completions``, ``POST {prefix}/v1/responses``,
    Anthropic's ``POST {prefix}/v1/messages`` (and ``/v1/messages/count_tokens``) and
    ``GET {prefix}/v1/models`` on ``router``, each call through a fresh ``recorder()``
    (one episode per call)."""
    _routes(router, lambda request: recorder(), model, prefix)


class _SharedTransport(httpx.AsyncBaseTransport):
    """Sends through a shared client's pool; closing it leaves the pool open."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._client.send(request, stream=True)

    async def aclose(self) -> None:
        return None


def serve_chat(
    router: Router,
    generator: Generator,
    tokenizer: Tokenizer,
    *,
    model: str,
    context_length: int,
) -> None:
    """OpenAI's ``/v1`` routes on ``router`` for ``generator`` (``agentenv serve``): each
    call one conversation through ``tokenizer``'s chat template, with the request's
    sampling, up to ``context_length`` tokens."""

    def recorder() -> EpisodeRecorder:
        episode = Episode(
            task=_CHAT_TASK,
            tokenizer=tokenizer,
            policy=generator,
            sampling=SamplingParams(max_new_tokens=context_length),
            limits=Limits(context_length=context_length),
        )
        return EpisodeRecorder(episode, request_sampling=True)

    chat_routes(router, recorder, model=model)


_CHAT_TASK = Task(id="chat")


@dataclasses.dataclass(slots=True)
class Endpoint:
    """One episode's (one role's) OpenAI-compatible endpoint.

    ``base_url`` is what an OpenAI client takes (``.../v1``); ``anthropic_base_url`` what
    an Anthropic client takes (the same without ``/v1``); ``recorder`` holds the calls'
    counts and state. Any API key is accepted (``Authorization: Bearer`` or
    ``x-api-key``): the path is the scope.
    """

    base_url: str
    key: str
    recorder: EpisodeRecorder
    _server: AgentServer
    _clients: list[Any] = dataclasses.field(default_factory=list)

    @property
    def anthropic_base_url(self) -> str:
        """The base URL an Anthropic client takes (it adds ``/v1/messages`` itself)."""
        return self.base_url.removesuffix("/v1")

    def client(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` pointed at this endpoint (the ``openai`` package is
        the agent's own dependency), sharing the server's connection pool; ``kwargs``
        go to ``AsyncOpenAI``. Retries are off: a refused call is the agent's to see."""
        try:
            import openai
        except ImportError:
            raise ConfigError(
                "Endpoint.client() needs the openai package: pip install openai, or hand "
                "the agent endpoint.base_url instead"
            ) from None
        options: dict[str, Any] = {"api_key": "agentenv", "max_retries": 0, **kwargs}
        # Its own httpx client (an agent may close it) over the server's shared pool;
        # openai takes an httpx client as well as its own httpx2 ones.
        http: Any = httpx.AsyncClient(
            transport=_SharedTransport(self._server.http_client),
            timeout=httpx.Timeout(None),
            trust_env=False,
        )
        return openai.AsyncOpenAI(base_url=self.base_url, http_client=http, **options)

    def anthropic_client(self, **kwargs: Any) -> Any:
        """An ``anthropic.AsyncAnthropic`` pointed at this endpoint, as :meth:`client`; its
        connections are its own (the SDK takes only its own HTTP client), closed when the
        episode gives the endpoint back."""
        try:
            import anthropic
            import httpx2
        except ImportError:
            raise ConfigError(
                "Endpoint.anthropic_client() needs the anthropic package: pip install "
                "anthropic, or hand the agent endpoint.anthropic_base_url instead"
            ) from None
        if self.recorder.closed:
            raise ConfigError("this episode's endpoint is closed")
        options: dict[str, Any] = {"api_key": "agentenv", "max_retries": 0, **kwargs}
        if "http_client" not in options:
            # No proxy from the environment: the endpoint is on this machine.
            options["http_client"] = httpx2.AsyncClient(
                timeout=httpx2.Timeout(None), trust_env=False
            )
        client = anthropic.AsyncAnthropic(base_url=self.anthropic_base_url, **options)
        self._clients.append(client)
        return client

    async def aclose_clients(self) -> None:
        """Close the Anthropic clients made by :meth:`anthropic_client`."""
        clients, self._clients = self._clients, []
        for client in clients:
            await client.close()

    def role(self, name: str) -> Endpoint:
        """The endpoint of role ``name`` in the same episode (its transcripts carry the
        role, and so its samples); made on first use, given back with this one."""
        return self._server.role_endpoint(self, name)

    def roles(self) -> list[Endpoint]:
        """The other roles' endpoints made so far."""
        return list(self._server.role_endpoints(self))

    def recorders(self) -> list[EpisodeRecorder]:
        """This endpoint's recorder and those of the other roles made so far."""
        return [self.recorder, *(e.recorder for e in self.roles())]

    def outcome(self) -> tuple[Status, str | None]:
        """How the episode's calls ended it: ``ABORTED`` or ``TRUNCATED`` with the reason
        when a refused call did (a policy that aborted; the context or the turn limit),
        else ``COMPLETED``, across every role's calls."""
        recorders = self.recorders()
        for status, reasons in (
            (Status.ABORTED, [r.aborted for r in recorders]),
            (Status.TRUNCATED, [r.truncated for r in recorders]),
        ):
            reason = next((x for x in reasons if x is not None), None)
            if reason is not None:
                return status, reason
        return Status.COMPLETED, None


class AgentServer:
    """The in-process HTTP server of the episodes' endpoints (loopback only).

    Args:
        model: the model name the endpoints report (``GET /v1/models``) and answer with.
        parser, request_sampling, max_turns: for each episode's
            :class:`~agentenv.endpoint.EpisodeRecorder`.
        host: the interface to bind (127.0.0.1: this machine only).
        max_body_bytes: a request body, at most (413 beyond, before it is read).
        body_timeout_s: seconds a body may take to arrive after its head (408 beyond).
        max_requests_per_endpoint: requests one endpoint may have in flight, bodies still
            arriving included (429 beyond), so one agent cannot take every connection.
        max_connections: connections held at once (:class:`~agentenv.http.HTTPServer`'s).
    """

    def __init__(
        self,
        *,
        model: str = "policy",
        parser: ToolCallParser | None = None,
        request_sampling: bool = False,
        max_turns: int | None = None,
        host: str = "127.0.0.1",
        max_body_bytes: int = MAX_BODY_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_requests_per_endpoint: int = MAX_REQUESTS_PER_ENDPOINT,
        max_connections: int | None = None,
    ) -> None:
        self.max_body_bytes = at_least("max_body_bytes", max_body_bytes, 1)
        self.body_timeout_s = positive("body_timeout_s", body_timeout_s)
        self.max_requests_per_endpoint = at_least(
            "max_requests_per_endpoint", max_requests_per_endpoint, 1
        )
        self.max_connections = max_connections
        self.model = model
        self.parser = parser
        self.request_sampling = request_sampling
        self.max_turns = max_turns
        self.host = host
        self._recorders: dict[str, EpisodeRecorder] = {}
        self._roles: dict[str, dict[str, Endpoint]] = {}
        self._users = 0
        self._url = ""
        self._client: httpx.AsyncClient | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._router = Router()
        _routes(self._router, self._recorder, model, f"{_PREFIX}{{key}}", models_check=True)

    @property
    def http_client(self) -> httpx.AsyncClient:
        """The connection pool the endpoints' clients share (while the server runs)."""
        if self._client is None:
            raise ConfigError("the agent server is not running: use it inside open()")
        return self._client

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` while the server runs."""
        return self._url

    @contextlib.asynccontextmanager
    async def open(self, episode: Episode, *, role: str | None = None) -> AsyncIterator[Endpoint]:
        """An endpoint for ``episode``, closed (its calls answered 410) on exit."""
        await self._acquire()
        try:
            endpoint = self._register(episode, role)
            try:
                yield endpoint
            finally:
                endpoints = [endpoint, *self._roles.pop(endpoint.key, {}).values()]
                for e in endpoints:
                    e.recorder.close()
                    self._recorders.pop(e.key, None)
                with anyio.CancelScope(shield=True):
                    for e in endpoints:
                        await e.aclose_clients()
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled episode gives it back too
                await self._release()

    def role_endpoint(self, parent: Endpoint, name: str) -> Endpoint:
        roles = self._roles.setdefault(parent.key, {})
        if name not in roles:
            if parent.recorder.closed:
                raise ConfigError("this episode's endpoint is closed")
            roles[name] = self._register(parent.recorder.episode, name)
        return roles[name]

    def role_endpoints(self, parent: Endpoint) -> Iterable[Endpoint]:
        return self._roles.get(parent.key, {}).values()

    def _register(self, episode: Episode, role: str | None) -> Endpoint:
        key = secrets.token_hex(8)
        recorder = EpisodeRecorder(
            episode,
            role=role,
            parser=self.parser,
            request_sampling=self.request_sampling,
            max_turns=self.max_turns,
        )
        self._recorders[key] = recorder
        return Endpoint(f"{self._url}{_PREFIX}{key}/v1", key, recorder, self)

    # -- routes --------------------------------------------------------------------------
    def _endpoint_of(self, method: str, path: str, headers: Mapping[str, str]) -> str | None:
        """The endpoint a request's head names (counted against
        ``max_requests_per_endpoint``); 410 before its body is read when no episode
        holds it."""
        if not path.startswith(_PREFIX):
            return None  # 404, unread
        key = path[len(_PREFIX) :].split("/", 1)[0]
        if key not in self._recorders:
            raise HTTPError(
                410,
                f"no episode holds the endpoint {key!r}: it has ended (or never existed)",
                type="invalid_request_error",
                code="episode_ended",
                headers=[("x-should-retry", "false")],
            )
        return key

    def _recorder(self, request: Request) -> EpisodeRecorder:
        key = request.path[len(_PREFIX) :].split("/", 1)[0]
        recorder = self._recorders.get(key)
        if recorder is None:
            raise ChatError(
                410,
                f"no episode holds the endpoint {key!r}: it has ended (or never existed)",
                code="episode_ended",
            )
        return recorder

    # -- lifetime: running while an episode holds an endpoint ------------------------------
    def _state_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:  # a new event loop (a new run)
            self._lock, self._loop = asyncio.Lock(), loop
            self._users, self._task, self._client = 0, None, None
        return self._lock

    async def _acquire(self) -> None:
        async with self._state_lock():
            if self._users == 0:
                await self._start()
            self._users += 1

    async def _release(self) -> None:
        async with self._state_lock():
            self._users -= 1
            if self._users == 0:
                await self._shutdown()

    async def _start(self) -> None:
        from agentenv._http import HTTPServer

        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()

        how = "raise it with the AgentEnv class attribute (or AgentServer argument)"
        http_server = HTTPServer(
            self._router,
            host=self.host,
            shutdown_grace=1.0,
            max_body_bytes=self.max_body_bytes,
            request_timeout=self.body_timeout_s,
            max_connections=self.max_connections,
            client_limit=ClientLimit(
                self._endpoint_of,
                self.max_requests_per_endpoint,
                hint=f"{how} max_requests_per_endpoint={self.max_requests_per_endpoint}",
            ),
            hints={
                "max_body_bytes": f"{how} max_body_bytes",
                "request_timeout": f"{how} body_timeout_s",
            },
        )

        async def serve() -> None:
            try:
                async with http_server as http:
                    started.set_result(http.url)
                    await stop.wait()
            except BaseException as e:
                if not started.done():
                    started.set_exception(e)
                raise

        self._stop = stop
        self._task = asyncio.create_task(serve(), name="agentenv agent server")
        self._url = await started
        self._client = httpx.AsyncClient(
            base_url=self._url,
            timeout=httpx.Timeout(None),
            transport=AiohttpTransport(max_connections=4096),
            trust_env=False,
        )

    async def _shutdown(self) -> None:
        client, task, stop = self._client, self._task, self._stop
        self._client = self._task = self._stop = None
        if client is not None:
            await client.aclose()
        if stop is not None:
            stop.set()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def endpoints(self) -> Iterable[str]:
        """The keys of the endpoints open now."""
        return list(self._recorders)
