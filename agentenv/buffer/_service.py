"""The Buffer as a service: remote rollout workers and trainers share one Buffer over HTTP.

:class:`BufferServer` serves a :class:`~agentenv.buffer.Buffer` (it does not own it: close
the Buffer yourself); :class:`BufferClient` is a drop-in for the Buffer on the other side:
the same method names, arguments, return types (:class:`Batch`, :class:`Group`,
:class:`BufferStats`) and exceptions (``SampleError``, ``ConfigError``,
``UnknownBatchError``, ``BufferStoreError``, ``ClosedResourceError``, ``TimeoutError``).
It is the runner's ``SampleSink``. Every method of the client is a coroutine, including
those that are plain methods on the Buffer (``statistics``, ``release_batch``, ...). ::

    async with Buffer(config, path="runs/exp1/buffer") as buffer, \\
            BufferServer(buffer, token=token, port=8411) as server:
        await anyio.sleep_forever()              # or: agentenv buffer serve ...

    async with BufferClient("http://10.0.0.5:8411", token=token) as buffer:
        await run_rollouts(env, tasks, policy, tokenizer=tok, sink=buffer)

Every request carries ``Authorization: Bearer <token>``; without the right token the
server answers 401 before it reads the request body. Samples travel in the exact binary
encoding of :mod:`agentenv.buffer._codec` (token ids and float64 log-probs bit for bit),
everything else as JSON. Errors are ``{"error": {"type": ..., "message": ...}}`` with an
HTTP status; the client raises the exception class named by ``type``.

Wire protocol (version 1, under ``/v1``)::

    POST /v1/put_group          body: encoded samples            -> 204
    POST /v1/put_groups         body: (u32 length | encoded samples) per group
                                -> {"errors": [null | {"type", "message"}]}, one per group
    POST /v1/get_batch          {groups, policy_version, timeout} -> batch frame (long poll)
    POST /v1/renew              {batches: [str]}
                                -> {"errors": [null | {"type", "message"}]}, one per batch
    POST /v1/ack                {batch, step}                    -> 204
    POST /v1/release_batch      {batch}                          -> 204
    GET  /v1/statistics                                          -> BufferStats as JSON
    GET  /v1/prompts_to_start?groups=N                           -> {"prompts": int}
    POST /v1/reserve            {prompts}                        -> 204 (long poll)
    POST /v1/release            {prompts}                        -> 204
    POST /v1/set_policy_version {version}                        -> 204
    POST /v1/recycled                                            -> {"tasks": [str]}
    GET  /v1/position                                            -> {"step": int | null}
    POST /v1/rewind             {step}                           -> {"groups": int}

A batch frame is ``u32 length | JSON {id, policy_version, lease_s, groups: [{group_id,
role, task_id, version, seq, n}]} | the batch's samples, encoded``.

Every request is validated before the Buffer sees it, puts are long polls (at most
``max_put_requests`` at once) and the client sends concurrent puts together and renews
its leases: what each of these means for a run, with its limits, is in docs/buffer.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import struct
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import anyio
import anyio.abc
import httpx
import pydantic

from agentenv._errors import AgentEnvError, ClosedResourceError, ConfigError, SampleError
from agentenv._http import (
    AiohttpTransport,
    Handler,
    HTTPError,
    Request,
    Response,
    Router,
)
from agentenv._sample import Sample

if TYPE_CHECKING:
    from agentenv._http import HTTPServer
from agentenv.buffer._buffer import (
    _INT64,
    Batch,
    Buffer,
    BufferStats,
    Group,
    LeaseExpiredError,
    UnknownBatchError,
)
from agentenv.buffer._codec import (
    FrameLimitError,
    decode_sample,
    decode_samples,
    encode_sample,
    join_frames,
    split_frames,
)
from agentenv.buffer._store import BufferStoreError

__all__ = ["BufferClient", "BufferServer", "BufferServiceError"]

log = logging.getLogger("agentenv.buffer")

SAMPLES_TYPE = "application/x-agentenv-samples"
BATCH_TYPE = "application/x-agentenv-batch"
PREFIX = "/v1"
_U32 = struct.Struct("<I")
_PUT_BYTES = 64 * 1024 * 1024  # the most one put_groups request carries
_PUT_SAMPLES = 8192  # ... and the most samples (well below the server's default limit)
_MAX_BODY_BYTES = 128 * 1024 * 1024  # the server's default body limit: two full requests
_MAX_SAMPLES = 65536  # the server's default limit on samples per request
# JSON header bytes (a sample's scalar fields and metadata): parsed, they cost up to ~50x
# their size ({} is 2 bytes, a dict 64), so they are bounded apart from the token arrays.
_MAX_SAMPLE_HEADER = 1024 * 1024  # the server's default limit per sample
_MAX_REQUEST_HEADERS = 8 * 1024 * 1024  # ... and per request (the client keeps below it)
# Groups of one put_groups request put at once: enough for big group commits, few enough
# that a request of many small groups does not start a task for each.
_PUT_WORKERS = 256
_MAX_RENEW = 4096  # batch ids per renew request
# Requests in flight at once: one keeps the server busy while the next is sent and the
# answer to the previous is read; more only split the queued groups into smaller requests.
_PUTS_IN_FLIGHT = 2
_PUTS_BUSY = "PutsBusy"  # the server's 503 when it handles max_put_requests already
_BUSY_RETRY_S = (0.02, 1.0)  # the client's first and longest wait before retrying it


class BufferServiceError(AgentEnvError):
    """The Buffer service was unreachable, refused the token, or failed unexpectedly.

    ``status`` is the HTTP status (``None`` when no answer came), ``type`` the server's
    error type.
    """

    def __init__(self, message: str, *, status: int | None = None, type: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.type = type


# Buffer exceptions and their HTTP statuses; the client re-raises them by ``type``. Order
# matters: the first matching class wins (UnknownBatchError is also a KeyError).
_ERRORS: tuple[tuple[type[BaseException], int], ...] = (
    (LeaseExpiredError, 409),
    (UnknownBatchError, 404),
    (SampleError, 400),
    (ConfigError, 400),
    (ClosedResourceError, 503),
    (TimeoutError, 408),
    (BufferStoreError, 500),
)
_KNOWN = tuple(cls for cls, _ in _ERRORS)
_RAISE: dict[str, type[BaseException]] = {cls.__name__: cls for cls, _ in _ERRORS}
_RAISE["ShuttingDown"] = ClosedResourceError


def _classify(e: BaseException) -> tuple[str, int]:
    """The wire type and HTTP status of a Buffer exception (first match in _ERRORS)."""
    cls, status = next((cls, code) for cls, code in _ERRORS if isinstance(e, cls))
    return cls.__name__, status


def _message(e: BaseException) -> str:
    # KeyError subclasses quote their message in str(); send the message itself.
    return str(e.args[0]) if len(e.args) == 1 else str(e)


def _error_json(e: BaseException) -> dict[str, str]:
    """A Buffer exception as one entry of a ``{"errors": [...]}`` answer."""
    return {"type": _classify(e)[0], "message": _message(e)}


# -- wire messages ------------------------------------------------------------------------
class _Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True, frozen=True)


# The integers the store keeps are SQLite's: 64-bit.
_Int64 = Annotated[int, pydantic.Field(ge=-_INT64, lt=_INT64)]
_Count = Annotated[int, pydantic.Field(ge=0, lt=_INT64)]
_BatchIdStr = Annotated[str, pydantic.Field(min_length=1, max_length=256)]


class _GetBatch(_Message):
    groups: Annotated[int, pydantic.Field(ge=1, lt=_INT64)] | None = None
    policy_version: _Int64 | None = None
    # Finite and >= 0; null waits as long as it takes.
    timeout: Annotated[float, pydantic.Field(ge=0, allow_inf_nan=False)] | None = None


class _BatchId(_Message):
    batch: _BatchIdStr


class _Ack(_BatchId):
    step: _Int64 | None = None


class _Renew(_Message):
    batches: Annotated[list[_BatchIdStr], pydantic.Field(max_length=_MAX_RENEW)]


class _Prompts(_Message):
    prompts: _Count = 1


class _Version(_Message):
    version: _Int64


class _Step(_Message):
    step: _Int64


class _Query(pydantic.BaseModel):
    # Query values are strings: parsed (lax), but only as integers.
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class _PromptsQuery(_Query):
    groups: _Count | None = None


_M = TypeVar("_M", bound=pydantic.BaseModel)


def _parse(model: type[_M], request: Request) -> _M:
    """The request's JSON body (its query string, for a :class:`_Query` model) as
    ``model``; :class:`HTTPError` 400 naming every bad field otherwise."""
    try:
        if issubclass(model, _Query):
            return model.model_validate(request.query)
        return model.model_validate_json(request.body or b"{}")
    except pydantic.ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()
        )
        raise HTTPError(400, f"bad {request.path} request: {problems}", type="BadRequest") from None


# A group's fields in a batch frame's JSON, beside its number of samples ``n``.
_GROUP_FIELDS = ("group_id", "role", "task_id", "version", "seq")


def encode_batch(batch: Batch) -> bytes:
    """A :class:`Batch` as a batch frame (see the module docstring)."""
    groups = [
        {**{k: getattr(g, k) for k in _GROUP_FIELDS}, "n": len(g.samples)} for g in batch.groups
    ]
    meta = json.dumps(
        {
            "id": batch.id,
            "policy_version": batch.policy_version,
            "lease_s": batch.lease_s,
            "groups": groups,
        },
        separators=(",", ":"),
    ).encode()
    blobs = (
        blob
        for g in batch.groups
        for blob in (g.encoded if g.encoded is not None else map(encode_sample, g.samples))
    )
    return b"".join((_U32.pack(len(meta)), meta, join_frames(blobs)))


def decode_batch(data: bytes) -> Batch:
    """Inverse of :func:`encode_batch`; :class:`BufferServiceError` on a malformed frame."""
    try:
        (n,) = _U32.unpack_from(data, 0)
        meta = json.loads(data[4 : 4 + n])
        samples = decode_samples(memoryview(data)[4 + n :])
        groups = []
        pos = 0
        for g in meta["groups"]:
            fields = {k: g[k] for k in _GROUP_FIELDS}
            groups.append(Group(**fields, samples=tuple(samples[pos : pos + g["n"]])))
            pos += g["n"]
        if pos != len(samples):
            raise ValueError(f"{len(samples)} samples for groups of {pos}")
        return Batch(meta["id"], tuple(groups), meta["policy_version"], meta.get("lease_s"))
    except (ValueError, KeyError, TypeError, struct.error, SampleError) as e:
        raise BufferServiceError(f"malformed batch from the Buffer service: {e}") from None


# -- server -------------------------------------------------------------------------------
class BufferServer:
    """Serves ``buffer`` over HTTP; an async context manager (``.port``, ``.url`` inside).

    Args:
        buffer: the Buffer to serve; the server does not close it.
        token: the shared secret every request must present as ``Authorization: Bearer``.
        host: interface to bind; the default serves this machine only. Bind a cluster
            interface (never a public one) to serve remote workers.
        port: TCP port; 0 picks a free one.
        max_body_bytes: the largest request body accepted (413 beyond); at least the
            client's 64 MiB requests.
        max_samples_per_request: the most samples one put request may carry (413 beyond):
            bounds the memory a request of many tiny samples takes.
        lease_s: seconds a batch stays with its consumer without a renewal (the client
            renews while it lives); then its groups go back to the ready queue.
        max_connections: connections held at once (default: the HTTP server's, from the
            descriptor limit).
        max_put_requests: put requests handled at once (default: half of
            ``max_connections``); beyond, 503 ``PutsBusy``, which :class:`BufferClient`
            retries: waiting producers leave connections free for consumers.
        max_sample_header_bytes: the largest JSON header (scalar fields and metadata) of
            one sample in a put (413 beyond); default 1 MiB.
        max_header_bytes_per_request: the most JSON header bytes one put request carries
            (413 beyond); default 8 MiB, which the client keeps below (docs/buffer.md says
            why the headers are bounded apart from the body).
    """

    def __init__(
        self,
        buffer: Buffer,
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = _MAX_BODY_BYTES,
        max_samples_per_request: int = _MAX_SAMPLES,
        lease_s: float = 60.0,
        max_connections: int | None = None,
        max_put_requests: int | None = None,
        max_sample_header_bytes: int = _MAX_SAMPLE_HEADER,
        max_header_bytes_per_request: int = _MAX_REQUEST_HEADERS,
    ) -> None:
        _check_token(token)
        for name, value, least in (
            ("max_sample_header_bytes", max_sample_header_bytes, 1024),
            ("max_header_bytes_per_request", max_header_bytes_per_request, _MAX_REQUEST_HEADERS),
            ("max_samples_per_request", max_samples_per_request, _PUT_SAMPLES),
        ):
            if type(value) is not int or value < least:
                raise ConfigError(
                    f"{name} must be an int >= {least} (what a client sends at most), got {value!r}"
                )
        self.max_sample_header_bytes = max_sample_header_bytes
        self.max_header_bytes_per_request = max_header_bytes_per_request
        if not (isinstance(lease_s, (int, float)) and 0 < lease_s < math.inf):
            raise ConfigError(f"lease_s must be a finite number of seconds > 0, got {lease_s!r}")
        self.buffer = buffer
        self.lease_s = float(lease_s)
        self.max_samples_per_request = max_samples_per_request
        self._expected = token.encode()
        router = Router()
        # Long polls: cancelled when their client disconnects. A put is withdrawn so while
        # it waits for room; once admitted, the Buffer completes it (see put_group).
        for method, name, handler, long_poll in (
            ("POST", "put_group", self._put_group, True),
            ("POST", "put_groups", self._put_groups, True),
            ("POST", "get_batch", self._get_batch, True),
            ("POST", "renew", self._renew, False),
            ("POST", "ack", self._ack, False),
            ("POST", "release_batch", self._release_batch, False),
            ("GET", "statistics", self._statistics, False),
            ("GET", "prompts_to_start", self._prompts_to_start, False),
            ("POST", "reserve", self._reserve, True),
            ("POST", "release", self._release, False),
            ("POST", "set_policy_version", self._set_policy_version, False),
            ("POST", "recycled", self._recycled, False),
            ("GET", "position", self._position, False),
            ("POST", "rewind", self._rewind, False),
        ):
            router.add(method, f"{PREFIX}/{name}", self._errors(handler), long_poll=long_poll)
        from agentenv._http import HTTPServer  # aiohttp: loaded by servers only

        self._http = HTTPServer(
            router,
            host=host,
            port=port,
            max_body_bytes=max_body_bytes,
            guard=self._authorize,
            max_connections=max_connections,
        )
        if max_put_requests is None:
            max_put_requests = max(1, self._http.max_connections // 2)
        if type(max_put_requests) is not int or max_put_requests < 1:
            raise ConfigError(
                f"max_put_requests must be an int >= 1 (or None: half the connections), "
                f"got {max_put_requests!r}"
            )
        self.max_put_requests = max_put_requests
        self._put_requests = 0  # put requests being handled now

    @property
    def port(self) -> int:
        """The bound TCP port (after start)."""
        return self._http.port

    @property
    def url(self) -> str:
        """``http://host:port``: give it to :class:`BufferClient`."""
        return self._http.url

    @property
    def http_server(self) -> HTTPServer:
        """The :class:`~agentenv.http.HTTPServer` serving the Buffer (its routes, guard and
        limits: to serve them elsewhere, or to watch its connections)."""
        return self._http

    async def __aenter__(self) -> BufferServer:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.__aexit__(*exc_info)

    async def aclose(self) -> None:
        """Stop serving (in-flight requests get a moment to finish); the Buffer stays open."""
        await self._http.aclose()

    def _authorize(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        scheme, _, presented = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), self._expected
        ):
            raise HTTPError(
                401,
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' with "
                "the token the server was started with (agentenv buffer serve --token-file)",
                type="AuthenticationError",
                headers=[("www-authenticate", 'Bearer realm="agentenv-buffer"')],
            )

    @staticmethod
    def _errors(handler: Callable[[Request], Awaitable[Response]]) -> Handler:
        # Buffer exceptions become error responses that the client turns back into them.
        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except _KNOWN as e:  # (an HTTPError is none of them: it passes as it is)
                name, status = _classify(e)
                raise HTTPError(status, _message(e), type=name) from None

        return handle

    def _frames(
        self, body: bytes | memoryview, what: str, item: str, limit: int
    ) -> list[memoryview]:
        try:
            return split_frames(body, what=what, item=item, limit=limit)
        except FrameLimitError:
            raise HTTPError(
                413,
                f"the request holds more than {self.max_samples_per_request} samples (found "
                f"in the {what}), the most one request may carry here; send fewer at once "
                "(or raise the server's --max-samples-per-request)",
                type="TooManySamples",
            ) from None

    def _decode_groups(
        self, body: bytes, *, grouped: bool
    ) -> list[tuple[list[Sample], list[bytes]]]:
        """The groups of a put body; every frame is split (and the samples counted) before
        any is decoded, so a hostile body is refused for the price of one linear pass."""
        limit = self.max_samples_per_request
        if grouped:
            frames = self._frames(body, "put_groups body", "group", limit)
        else:
            frames = [memoryview(body)]
        records = []
        for k, frame in enumerate(frames):
            what = f"group {k} of the put_groups body" if grouped else "put_group body"
            records.append(self._frames(frame, what, "sample", limit))
            limit -= len(records[-1])
        self._check_headers(records)
        out = []
        for frames_of_group in records:
            blobs = [bytes(frame) for frame in frames_of_group]
            out.append(([decode_sample(blob) for blob in blobs], blobs))
        return out

    def _check_headers(self, groups: list[list[memoryview]]) -> None:
        # Each sample's JSON header length is its first u32 (a frame too short for one is
        # refused by the decoder): summed before any is parsed.
        total = 0
        for k, frames in enumerate(groups):
            for i, frame in enumerate(frames):
                if len(frame) < 4:
                    continue
                (n,) = _U32.unpack_from(frame, 0)
                if n > self.max_sample_header_bytes:
                    raise HTTPError(
                        413,
                        f"sample {i} of group {k} has a {n}-byte JSON header (its metadata, "
                        f"mostly); this server takes at most {self.max_sample_header_bytes} "
                        "bytes per sample (max_sample_header_bytes): keep metadata small",
                        type="HeaderTooLarge",
                    )
                total += n
                if total > self.max_header_bytes_per_request:
                    raise HTTPError(
                        413,
                        f"the request's samples have over {self.max_header_bytes_per_request} "
                        "bytes of JSON headers (their metadata, mostly), the most one "
                        "request may carry here (max_header_bytes_per_request); send fewer "
                        "samples at once or keep metadata small",
                        type="HeaderTooLarge",
                    )

    @contextlib.contextmanager
    def _put_request(self) -> Iterator[None]:
        if self._put_requests >= self.max_put_requests:
            raise HTTPError(
                503,
                f"{self._put_requests} put requests are in progress (waiting for room in a "
                f"full Buffer, most likely), the most this server handles at once "
                f"(max_put_requests); retry shortly",
                type=_PUTS_BUSY,
                headers=[("retry-after", "1")],
            )
        self._put_requests += 1
        try:
            yield
        finally:
            self._put_requests -= 1

    async def _put_group(self, request: Request) -> Response:
        with self._put_request():
            ((samples, blobs),) = self._decode_groups(request.body, grouped=False)
            await self.buffer._put_encoded(samples, blobs)
        return Response.empty()

    async def _put_groups(self, request: Request) -> Response:
        with self._put_request():
            groups = self._decode_groups(request.body, grouped=True)
            errors: list[dict[str, str] | None] = [None] * len(groups)
            todo = iter(enumerate(groups))

            async def put() -> None:
                for k, (samples, blobs) in todo:
                    try:
                        await self.buffer._put_encoded(samples, blobs)
                    except _KNOWN as e:
                        errors[k] = _error_json(e)

            # Concurrently, so that a durable Buffer commits them together; by a bounded
            # pool of tasks, each taking the next group when its last is stored.
            async with anyio.create_task_group() as tg:
                for _ in range(min(len(groups), _PUT_WORKERS)):
                    tg.start_soon(put)
        return Response.json({"errors": errors})

    async def _get_batch(self, request: Request) -> Response:
        args = _parse(_GetBatch, request)
        try:
            batch = await self.buffer.get_batch(
                args.groups,
                policy_version=args.policy_version,
                timeout=args.timeout,
                lease_s=self.lease_s,
            )
        except TimeoutError:
            wanted = args.groups or self.buffer.config.rollout_batch_size
            raise TimeoutError(
                f"no batch of {wanted} groups was ready within {args.timeout} s"
            ) from None

        async def put_back() -> None:
            # The client left before the batch reached it: give its groups to the next.
            with contextlib.suppress(UnknownBatchError):  # settled meanwhile
                await self.buffer.release_batch(batch)

        return Response(encode_batch(batch), content_type=BATCH_TYPE, on_undelivered=put_back)

    async def _renew(self, request: Request) -> Response:
        errors: list[dict[str, str] | None] = []
        for batch_id in _parse(_Renew, request).batches:
            try:
                await self.buffer.renew(batch_id)
                errors.append(None)
            except UnknownBatchError as e:
                errors.append(_error_json(e))
        return Response.json({"errors": errors})

    async def _ack(self, request: Request) -> Response:
        args = _parse(_Ack, request)
        await self.buffer.ack(args.batch, step=args.step)
        return Response.empty()

    async def _release_batch(self, request: Request) -> Response:
        await self.buffer.release_batch(_parse(_BatchId, request).batch)
        return Response.empty()

    async def _statistics(self, request: Request) -> Response:
        stats = (await self.buffer.statistics()).to_dict()
        del stats["pass_rate"]  # a property, recomputed by the client
        return Response.json(stats)

    async def _prompts_to_start(self, request: Request) -> Response:
        groups = _parse(_PromptsQuery, request).groups
        return Response.json({"prompts": (await self.buffer.prompts_to_start(groups))})

    async def _reserve(self, request: Request) -> Response:
        prompts = _parse(_Prompts, request).prompts
        await self.buffer.reserve(prompts)

        async def give_back() -> None:
            await self.buffer.release(prompts)

        return Response(status=204, on_undelivered=give_back)

    async def _release(self, request: Request) -> Response:
        await self.buffer.release(_parse(_Prompts, request).prompts)
        return Response.empty()

    async def _set_policy_version(self, request: Request) -> Response:
        await self.buffer.set_policy_version(_parse(_Version, request).version)
        return Response.empty()

    async def _recycled(self, request: Request) -> Response:
        return Response.json({"tasks": (await self.buffer.recycled())})

    async def _position(self, request: Request) -> Response:
        return Response.json({"step": (await self.buffer.position())})

    async def _rewind(self, request: Request) -> Response:
        groups = await self.buffer.rewind(_parse(_Step, request).step)
        return Response.json({"groups": groups})


def _check_token(token: str) -> None:
    if not (isinstance(token, str) and token.isprintable() and token.split() == [token]):
        raise ConfigError(
            "the Buffer service token must be a non-empty printable string without "
            "whitespace; generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )


# -- client -------------------------------------------------------------------------------
class BufferClient:
    """A remote Buffer: the same methods as :class:`~agentenv.buffer.Buffer`, all async.

    Args:
        url: the server's URL (``BufferServer.url``, or what ``agentenv buffer serve``
            printed).
        token: the server's token.
        timeout: seconds for requests that do not wait for the Buffer (``ack``,
            ``statistics``, ...). ``put_group`` (backpressure), ``get_batch`` and
            ``reserve`` wait as long as the Buffer makes them (``get_batch(timeout=)``
            bounds it).
        max_connections: concurrent requests (producers) at most.

    Proxy environment variables are ignored: the Buffer is reached directly. Use it as an
    async context manager: inside, it renews the leases of the batches it holds in the
    background (see the module docstring), so ``get_batch`` needs it.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        timeout: float = 60.0,
        max_connections: int = 64,
    ) -> None:
        _check_token(token)
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"the Buffer service URL must start with http://, got {url!r}")
        if not timeout > 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.url = url.rstrip("/")
        self._timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self._wait = httpx.Timeout(timeout, connect=min(timeout, 10.0), read=None)
        self._http = httpx.AsyncClient(
            base_url=self.url + PREFIX,
            headers={"authorization": f"Bearer {token}"},
            timeout=self._timeout,
            transport=AiohttpTransport(max_connections=max_connections),
            trust_env=False,
        )
        self._closed = False
        self._puts: collections.deque[_QueuedPut] = collections.deque()
        self._putting = 0  # put requests in flight
        self._put_sent = anyio.Event()
        self._held: dict[str, float] = {}  # leased batches held: id -> lease_s
        self._held_changed = anyio.Event()
        self._renewals: anyio.abc.TaskGroup | None = None

    @property
    def http_client(self) -> httpx.AsyncClient:
        """The httpx client its requests go through (e.g. to add ``event_hooks``)."""
        return self._http

    async def __aenter__(self) -> BufferClient:
        renewals = anyio.create_task_group()
        await renewals.__aenter__()
        renewals.start_soon(self._renew_leases)
        self._renewals = renewals
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.aclose()
        finally:
            if self._renewals is not None:
                renewals, self._renewals = self._renewals, None
                renewals.cancel_scope.cancel()
                await renewals.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close the connections; later calls raise :class:`ClosedResourceError`."""
        if not self._closed:
            self._closed = True
            if self._renewals is not None:
                self._renewals.cancel_scope.cancel()
            await self._http.aclose()

    async def _renew_leases(self) -> None:
        # While it holds leased batches: one renew request for all of them every third of
        # the shortest lease, so two may fail (a slow or restarting server) before one runs
        # out. Batches the server no longer knows are forgotten: ack will say why.
        while True:
            if not self._held:
                changed = self._held_changed
                await changed.wait()
                continue
            await anyio.sleep(min(self._held.values()) / 3)
            held = list(self._held)[:_MAX_RENEW]
            if not held:
                continue
            try:
                errors = await self._renew(held)
            except Exception as e:
                # A background renewal must never take down the task that holds the
                # client (its task group is the caller's); the next round tries again.
                log.warning("agentenv buffer: renewing %d batch leases failed: %s", len(held), e)
                continue
            for batch_id, error in zip(held, errors, strict=True):
                if error is not None:
                    self._held.pop(batch_id, None)

    async def _renew(self, batch_ids: list[str]) -> list[BaseException | None]:
        response = await self._call("POST", "renew", json_body={"batches": batch_ids})
        return _errors(response, len(batch_ids), "leases")

    async def _call(
        self,
        method: str,
        name: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        wait: httpx.Timeout | None = None,
    ) -> httpx.Response:
        if self._closed:
            raise ClosedResourceError("the BufferClient is closed")
        headers = None
        if json_body is not None:
            content = json.dumps(json_body, separators=(",", ":")).encode()
            headers = {"content-type": "application/json"}
        elif content is not None:
            headers = {"content-type": SAMPLES_TYPE}
        try:
            response = await self._http.request(
                method,
                "/" + name,
                content=content,
                params=params,
                headers=headers,
                timeout=wait or self._timeout,
            )
        except httpx.TimeoutException as e:
            raise BufferServiceError(
                f"the Buffer service at {self.url} did not answer {name} in time ({e!r})"
            ) from None
        except httpx.TransportError as e:
            raise BufferServiceError(
                f"cannot reach the Buffer service at {self.url} ({type(e).__name__}: {e}); "
                "is `agentenv buffer serve` running there?"
            ) from None
        if response.status_code >= 400:
            _raise(response, self.url, name)
        return response

    # -- producing --------------------------------------------------------------------
    async def put_group(self, samples: Sequence[Sample]) -> None:
        """:meth:`Buffer.put_group <agentenv.buffer.Buffer.put_group>` over the wire."""
        samples = list(samples)
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise SampleError(f"put_group takes Sample objects, item {i} is {type(s).__name__}")
        blobs = [encode_sample(s) for s in samples]
        headers = sum(_U32.unpack_from(blob, 0)[0] for blob in blobs)
        put = _QueuedPut(join_frames(blobs), len(samples), headers)
        self._puts.append(put)
        try:
            while not put.done:
                if put.sent or self._putting >= _PUTS_IN_FLIGHT:
                    event = self._put_sent
                    await event.wait()
                else:
                    await self._send_puts()
        except BaseException:
            if not put.sent:  # cancelling a put that has not left withdraws it
                self._puts.remove(put)
            raise
        if put.error is not None:
            raise put.error

    async def _send_puts(self) -> None:
        # Whoever finds a request slot free sends every queued group (up to a size) in one
        # request, shielded: the request serves other callers, whose groups must not be
        # abandoned halfway because this caller was cancelled.
        self._putting += 1
        try:
            with anyio.CancelScope(shield=True):
                taken: list[_QueuedPut] = []
                size = count = headers = 0
                while self._puts and (
                    not taken
                    or (
                        size + len(self._puts[0].blob) <= _PUT_BYTES
                        and count + self._puts[0].n <= _PUT_SAMPLES
                        and headers + self._puts[0].headers <= _MAX_REQUEST_HEADERS
                    )
                ):
                    put = self._puts.popleft()
                    put.sent = True
                    taken.append(put)
                    size += len(put.blob) + 4
                    count += put.n
                    headers += put.headers
                results: list[BaseException | None]
                try:
                    results = await self._put_groups([put.blob for put in taken])
                except Exception as e:  # the whole request failed: every caller learns why
                    results = [e] * len(taken)
                for put, result in zip(taken, results, strict=True):
                    put.error, put.done = result, True
        finally:
            self._putting -= 1
            self._put_sent.set()
            self._put_sent = anyio.Event()

    async def _put_call(self, name: str, content: bytes) -> httpx.Response:
        # A server handling its most put requests (producers waiting on a full Buffer)
        # answers 503 PutsBusy at once: wait and retry, as the put would have waited.
        delay, longest = _BUSY_RETRY_S
        while True:
            try:
                return await self._call("POST", name, content=content, wait=self._wait)
            except BufferServiceError as e:
                if e.status != 503 or e.type != _PUTS_BUSY:
                    raise
            await anyio.sleep(delay)
            delay = min(longest, delay * 2)

    async def _put_groups(self, blobs: list[bytes]) -> list[BaseException | None]:
        if len(blobs) == 1:
            try:
                await self._put_call("put_group", blobs[0])
            except Exception as e:
                return [e]
            return [None]
        return _errors(await self._put_call("put_groups", join_frames(blobs)), len(blobs), "groups")

    async def reserve(self, prompts: int = 1) -> None:
        """:meth:`Buffer.reserve <agentenv.buffer.Buffer.reserve>`: wait for admission."""
        await self._call("POST", "reserve", json_body={"prompts": prompts}, wait=self._wait)

    async def release(self, prompts: int = 1) -> None:
        """:meth:`Buffer.release <agentenv.buffer.Buffer.release>`."""
        await self._call("POST", "release", json_body={"prompts": prompts})

    async def prompts_to_start(self, groups: int | None = None) -> int:
        """:meth:`Buffer.prompts_to_start <agentenv.buffer.Buffer.prompts_to_start>`."""
        params = None if groups is None else {"groups": groups}
        data = (await self._call("GET", "prompts_to_start", params=params)).json()
        return int(data["prompts"])

    async def recycled(self) -> list[str]:
        """:meth:`Buffer.recycled <agentenv.buffer.Buffer.recycled>`: taken once."""
        data = (await self._call("POST", "recycled")).json()
        return [str(t) for t in data["tasks"]]

    # -- consuming --------------------------------------------------------------------
    async def get_batch(
        self,
        groups: int | None = None,
        *,
        policy_version: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the Buffer's own deadline, passed on
    ) -> Batch:
        """:meth:`Buffer.get_batch <agentenv.buffer.Buffer.get_batch>` over the wire.

        The batch is leased (the server's ``lease_s``); this client renews the lease in
        the background until the batch is acknowledged or released.
        """
        if self._renewals is None and not self._closed:
            raise ConfigError(
                "BufferClient.get_batch needs the client entered (`async with "
                "BufferClient(url, token=...) as buffer:`): inside, it renews the leases of "
                "the batches it holds, which would otherwise go to another consumer"
            )
        wait = self._wait
        if timeout is not None:  # the server answers 408 at `timeout`; allow for transit
            wait = httpx.Timeout(
                self._timeout.write, connect=self._timeout.connect, read=timeout + 30
            )
        response = await self._call(
            "POST",
            "get_batch",
            json_body={"groups": groups, "policy_version": policy_version, "timeout": timeout},
            wait=wait,
        )
        batch = decode_batch(response.content)
        if batch.lease_s is not None:  # renewed in the background from now on
            self._held[batch.id] = batch.lease_s
            self._held_changed.set()
            self._held_changed = anyio.Event()
        return batch

    async def renew(self, batch: Batch | str) -> None:
        """:meth:`Buffer.renew <agentenv.buffer.Buffer.renew>`; this client also renews the
        batches it holds in the background, so calling it is seldom needed."""
        batch_id = batch if isinstance(batch, str) else batch.id
        (error,) = await self._renew([batch_id])
        if error is not None:
            self._held.pop(batch_id, None)
            raise error

    async def ack(self, batch: Batch | str, *, step: int | None = None) -> None:
        """:meth:`Buffer.ack <agentenv.buffer.Buffer.ack>`: durable before it returns."""
        batch_id = batch if isinstance(batch, str) else batch.id
        try:
            await self._call("POST", "ack", json_body={"batch": batch_id, "step": step})
        except UnknownBatchError:
            self._held.pop(batch_id, None)
            raise
        self._held.pop(batch_id, None)

    async def release_batch(self, batch: Batch | str) -> None:
        """:meth:`Buffer.release_batch <agentenv.buffer.Buffer.release_batch>`."""
        batch_id = batch if isinstance(batch, str) else batch.id
        try:
            await self._call("POST", "release_batch", json_body={"batch": batch_id})
        finally:
            self._held.pop(batch_id, None)

    async def set_policy_version(self, version: int) -> None:
        """:meth:`Buffer.set_policy_version <agentenv.buffer.Buffer.set_policy_version>`."""
        await self._call("POST", "set_policy_version", json_body={"version": version})

    async def position(self) -> int | None:
        """:meth:`Buffer.position <agentenv.buffer.Buffer.position>`."""
        step = (await self._call("GET", "position")).json()["step"]
        return None if step is None else int(step)

    async def rewind(self, step: int) -> int:
        """:meth:`Buffer.rewind <agentenv.buffer.Buffer.rewind>`."""
        return int((await self._call("POST", "rewind", json_body={"step": step})).json()["groups"])

    async def statistics(self) -> BufferStats:
        """:meth:`Buffer.statistics <agentenv.buffer.Buffer.statistics>`."""
        data = (await self._call("GET", "statistics")).json()
        names = {f.name for f in dataclasses.fields(BufferStats)}
        values = {k: v for k, v in data.items() if k in names}
        values["dropped"] = collections.Counter(values.get("dropped", {}))
        return BufferStats(**values)


@dataclasses.dataclass(slots=True, eq=False)
class _QueuedPut:
    """One ``put_group`` call waiting for a request to carry its group."""

    blob: bytes
    n: int  # samples
    headers: int  # JSON header bytes of its samples
    sent: bool = False
    done: bool = False
    error: BaseException | None = None


def _exception(kind: str, message: str) -> BaseException:
    cls = _RAISE.get(kind)
    return cls(message) if cls is not None else BufferServiceError(message, type=kind)


def _errors(response: httpx.Response, n: int, what: str) -> list[BaseException | None]:
    """The exceptions of a ``{"errors": [...]}`` answer for ``n`` items (None: it worked)."""
    errors = response.json()["errors"]
    if len(errors) != n:
        raise BufferServiceError(
            f"the Buffer service answered {len(errors)} results for {n} {what}"
        )
    return [None if e is None else _exception(e["type"], e["message"]) for e in errors]


def _raise(response: httpx.Response, url: str, name: str) -> NoReturn:
    status = response.status_code
    try:
        error = response.json()["error"]
        kind, message = str(error["type"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        kind, message = "", response.text[:500]
    if kind in _RAISE:
        raise _exception(kind, message)
    raise BufferServiceError(
        f"the Buffer service at {url} refused {name} with {status} {kind}: {message}",
        status=status,
        type=kind,
    )
