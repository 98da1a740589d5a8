"""An async client for SGLang's native HTTP API (and for ``agentenv serve``, which speaks it).

:class:`SGLangClient` is a :class:`~agentenv.Generator`: token ids in, token ids,
log-probs, finish reason and weight version out, exactly as the server returns them. It
also drives the server: batches, streaming, abort, pause/continue, cache flush, health,
weight updates (from disk, from tensors, over NCCL) and a router's worker list. ::

    async with SGLangClient("http://127.0.0.1:30000") as llm:
        await llm.wait_healthy(timeout=600)
        completion = await llm.generate(prompt_ids, SamplingParams(max_new_tokens=64))

Requests that fail to connect, lose their connection, or get a 5xx answer are retried
with exponential backoff (``retries`` times), then raise :class:`SGLangError` naming the
URL; a 4xx answer is never retried and raises at once with the server's message.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import urlencode

import anyio

from agentenv._errors import ClosedResourceError, ConfigError, GenerationError
from agentenv._generator import Completion, CompletionBuilder, FinishReason, SamplingParams
from agentenv._http import check_api_key

if TYPE_CHECKING:
    import aiohttp

__all__ = ["SGLangClient", "SGLangError", "StreamChunk"]

ROUTING_HEADER = "X-SMG-Routing-Key"
PauseMode = Literal["abort", "retract", "in_place"]
T = TypeVar("T")


class SGLangError(GenerationError):
    """The server refused a request (``status`` 4xx), failed (5xx) or could not be reached
    (``status`` None) after the allowed retries. The message names the URL."""

    def __init__(self, message: str, *, status: int | None = None, url: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.url = url


@dataclasses.dataclass(slots=True)
class StreamChunk:
    """What one server-sent event of a streamed generation added.

    ``output_ids``/``logprobs`` are the new tokens only (however the server sends them:
    cumulatively, SGLang's default, or incrementally); ``finish_reason`` is set on the last
    chunk. ``weight_version`` is the server's version when the chunk was produced.
    """

    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason | None
    weight_version: str


def _check_input(input_ids: Sequence[int], field: str = "input_ids") -> list[int]:
    ids = list(input_ids)
    if not ids:
        raise ConfigError(f"{field} is empty: a generation needs at least one prompt token")
    if not all(type(t) is int and t >= 0 for t in ids):
        bad = next(t for t in ids if type(t) is not int or t < 0)
        raise ConfigError(f"{field} must be non-negative ints, got {bad!r}")
    return ids


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    """A whole answer: its status and body."""

    status_code: int
    reason_phrase: str
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _message(response: _Answer) -> str:
    """The error text of an SGLang answer, whichever of its shapes it has."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:1000] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
    return json.dumps(data)[:1000]


class SGLangClient:
    """One SGLang server or router (or ``agentenv serve``).

    Args:
        url: ``http://host:port`` of the server or router.
        timeout: seconds one request may take (a long generation included).
        connect_timeout: seconds to establish a connection.
        max_connections: requests in flight at once; more wait for a free connection.
            Size it for every concurrent episode (thousands are fine).
        retries: extra attempts after a connection error or a 5xx answer.
        backoff: seconds before the first retry; doubles each time (with jitter), capped
            at ``max_backoff``.
        sticky_routing: send ``X-SMG-Routing-Key`` (a router's consistent-hashing key)
            with every generate, so that every turn of an episode goes to one server and
            reuses its prefix cache. The key is the ``rid`` up to its last ``/`` -- the
            episode, for the rids :class:`~agentenv.Episode` makes -- unless given.
        headers: sent with every request.
        api_key: the server's ``--api-key`` (SGLang's, or ``agentenv serve``'s), sent as
            ``Authorization: Bearer <key>`` with every request.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 3600.0,
        connect_timeout: float = 10.0,
        max_connections: int = 4096,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        sticky_routing: bool = True,
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"url must start with http:// or https://, got {url!r}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ConfigError("timeout and connect_timeout must be positive")
        if retries < 0 or backoff < 0 or max_backoff < 0:
            raise ConfigError("retries, backoff and max_backoff must be non-negative")
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.sticky_routing = sticky_routing
        headers = dict(headers or {})
        if api_key is not None:
            headers["Authorization"] = f"Bearer {check_api_key(api_key)}"
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None  # made in the event loop
        self._closed = False

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections; later calls raise :class:`ClosedResourceError`."""
        if not self._closed:
            self._closed = True
            if self._session is not None:
                with anyio.CancelScope(shield=True):  # closing completes, even when cancelled
                    await self._session.close()

    # -- transport -------------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        """The connection pool (aiohttp's: ``agentenv bench client`` measured it against
        a client of agentenv's own, see docs/benchmarks.md), made on first use."""
        if self._closed:
            raise ClosedResourceError("the SGLangClient is closed")
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=self.connect_timeout),
                trust_env=False,  # proxies from the environment: the server is reached directly
            )
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        retry: bool = True,
    ) -> _Answer:
        import aiohttp

        session = self._http()
        content = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        hdrs = dict(headers or {})
        if content is not None:
            hdrs["content-type"] = "application/json"
        url = self.url + path + ("?" + urlencode(params) if params else "")
        delay = self.backoff
        retries = self.retries if retry else 0
        for attempt in range(retries + 1):
            last = attempt == retries
            try:
                # (aiohttp sends a body of over 1 MiB from a file object, a piece at a time.)
                data = io.BytesIO(content) if content and len(content) > 1 << 20 else content
                async with session.request(method, url, data=data, headers=hdrs) as answer:
                    response = _Answer(answer.status, answer.reason or "", await answer.read())
            except TimeoutError as e:
                raise SGLangError(
                    f"{method} {self.url}{path} timed out ({type(e).__name__})", url=self.url
                ) from None
            except aiohttp.ClientError as e:
                if last:
                    raise SGLangError(
                        f"cannot reach the SGLang server at {self.url} ({method} {path}: "
                        f"{type(e).__name__}: {e}) after {retries + 1} "
                        f"attempt{'s' if retries else ''}",
                        url=self.url,
                    ) from None
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500 or last:
                    raise self._refused(method, path, response)
            await anyio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self.max_backoff)
        raise AssertionError("unreachable")  # pragma: no cover

    def _refused(self, method: str, path: str, answer: _Answer) -> SGLangError:
        return SGLangError(
            f"{method} {self.url}{path} answered {answer.status_code}: {_message(answer)}",
            status=answer.status_code,
            url=self.url,
        )

    async def _json(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        response = await self._request(method, path, body=body, **kw)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    def _routing(self, rid: str | None, key: str | None) -> dict[str, str] | None:
        if not self.sticky_routing:
            return None
        key = key or (rid.rpartition("/")[0] or rid if rid else None)
        return {ROUTING_HEADER: key} if key else None

    # -- generation ------------------------------------------------------------------------
    def _generate_body(
        self,
        input_ids: Any,
        params: SamplingParams,
        rid: str | list[str] | None,
        return_logprob: bool,
        stream: bool,
    ) -> dict[str, Any]:
        """The ``/generate`` body, its sampling parameters checked first."""
        params.verify()
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": params.to_sglang(),
            "return_logprob": return_logprob,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "stream": stream,
        }
        if rid is not None:
            body["rid"] = rid
        return body

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
        return_logprob: bool = True,
    ) -> Completion:
        """Generate a continuation of ``input_ids`` (``POST /generate``)."""
        ids = _check_input(input_ids)
        data = await self._json(
            "POST",
            "/generate",
            self._generate_body(ids, params, rid, return_logprob, False),
            headers=self._routing(rid, routing_key),
        )
        return parse_completion(data, return_logprob, url=self.url)

    async def generate_batch(
        self,
        batch: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> list[Completion]:
        """Several prompts in one request; completions in the prompts' order.

        ``rid`` names the requests ``rid_0``, ``rid_1``, ... (SGLang's convention).
        """
        if not batch:
            raise ConfigError("generate_batch needs at least one prompt")
        ids = [_check_input(p, f"input_ids[{i}]") for i, p in enumerate(batch)]
        rids = None if rid is None else [f"{rid}_{i}" for i in range(len(ids))]
        data = await self._json(
            "POST", "/generate", self._generate_body(ids, params, rids, return_logprob, False)
        )
        if not isinstance(data, list) or len(data) != len(ids):
            raise SGLangError(
                f"{self.url}/generate answered a batch of {len(ids)} with "
                f"{len(data) if isinstance(data, list) else type(data).__name__}",
                url=self.url,
            )
        return [parse_completion(d, return_logprob, url=self.url) for d in data]

    async def stream(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
        return_logprob: bool = True,
    ) -> AsyncIterator[StreamChunk]:
        """Generate with ``"stream": true``; yields the tokens as they come.

        Not retried once the stream has started: a broken stream raises
        :class:`SGLangError`.
        """
        import aiohttp

        ids = _check_input(input_ids)
        body = self._generate_body(ids, params, rid, return_logprob, True)
        session = self._http()
        headers = {"content-type": "application/json", **(self._routing(rid, routing_key) or {})}
        seen_ids = 0
        try:
            async with session.post(
                self.url + "/generate",
                data=json.dumps(body, separators=(",", ":")).encode(),
                headers=headers,
            ) as response:
                if response.status >= 400:
                    answer = _Answer(response.status, response.reason or "", await response.read())
                    raise self._refused("POST", "/generate", answer)
                async for line in _lines(response.content):
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk, seen_ids = _parse_chunk(
                        json.loads(payload), seen_ids, return_logprob, self.url
                    )
                    yield chunk
        except (aiohttp.ClientError, TimeoutError) as e:
            raise SGLangError(
                f"the stream from {self.url}/generate broke ({type(e).__name__}: {e})",
                url=self.url,
            ) from None

    async def generate_streamed(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        routing_key: str | None = None,
    ) -> Completion:
        """:meth:`generate` over a stream: the completion records which weight version
        produced which tokens (``version_spans``), even across an in-place weight update."""
        parts = CompletionBuilder()
        finish: FinishReason | None = None
        async for chunk in self.stream(input_ids, params, rid=rid, routing_key=routing_key):
            parts.add(chunk.output_ids, chunk.logprobs, chunk.weight_version)
            if chunk.finish_reason is not None:
                finish = chunk.finish_reason
        if finish is None:
            raise SGLangError(f"the stream from {self.url}/generate ended without a finish reason")
        return parts.build(finish)

    # -- control ---------------------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Abort request ``rid`` (a no-op if it is unknown or finished). It returns what it
        generated so far with ``finish_reason.type == "abort"``."""
        await self._request("POST", "/abort_request", body={"rid": rid})

    async def abort_all(self) -> None:
        """Abort every running request."""
        await self._request("POST", "/abort_request", body={"rid": "", "abort_all": True})

    async def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating (before a weight update). ``abort``: running requests return
        what they have; ``retract``: they wait, their cache dropped; ``in_place``: they
        wait, cache kept."""
        if mode not in ("abort", "retract", "in_place"):
            raise ConfigError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        await self._request("POST", "/pause_generation", body={"mode": mode})

    async def resume(self) -> None:
        """Continue after :meth:`pause` (``POST /continue_generation``)."""
        await self._request("POST", "/continue_generation", body={})

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Give the GPU memory back while training runs (colocated):
        ``POST /release_memory_occupation``; ``tags`` of ``weights``, ``kv_cache``,
        ``cuda_graph`` (default: all). The server refuses to generate until resumed."""
        await self._request("POST", "/release_memory_occupation", body=_tags(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take back what :meth:`release_memory_occupation` gave:
        ``POST /resume_memory_occupation``."""
        await self._request("POST", "/resume_memory_occupation", body=_tags(tags))

    async def flush_cache(self) -> None:
        """Drop the prefix cache (the server refuses while requests run)."""
        await self._request("POST", "/flush_cache")

    async def health(self, *, generate: bool = False) -> bool:
        """Whether the server answers ``/health`` (``/health_generate``: it can generate)."""
        import aiohttp

        path = "/health_generate" if generate else "/health"
        try:
            async with self._http().get(self.url + path) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def wait_healthy(
        self,
        timeout: float = 600.0,  # noqa: ASYNC109 - a deadline for the whole wait
        *,
        generate: bool = False,
        interval: float = 0.5,
    ) -> None:
        """Wait until the server is healthy; :class:`SGLangError` after ``timeout`` s."""
        with anyio.move_on_after(timeout):
            while not await self.health(generate=generate):  # noqa: ASYNC110 - polling a server
                await anyio.sleep(interval)
            return
        raise SGLangError(
            f"the SGLang server at {self.url} was not healthy within {timeout} s", url=self.url
        )

    async def model_info(self) -> dict[str, Any]:
        """``/get_model_info`` (``/model_info`` on newer servers)."""
        return await self._get_either("/get_model_info", "/model_info")

    async def server_info(self) -> dict[str, Any]:
        """``/get_server_info`` (``/server_info`` on newer servers)."""
        return await self._get_either("/get_server_info", "/server_info")

    async def _get_either(self, old: str, new: str) -> dict[str, Any]:
        data = await _or_older(self._json("GET", old), lambda: self._json("GET", new))
        if not isinstance(data, dict):
            raise SGLangError(f"{self.url}{old} did not answer a JSON object", url=self.url)
        return data

    async def weight_version(self) -> str:
        """The server's current weight version (``/get_weight_version``, or the model info
        on servers that retired that route)."""
        data = await _or_older(self._json("GET", "/get_weight_version"), self.model_info)
        if not isinstance(data, dict) or "weight_version" not in data:
            raise SGLangError(f"{self.url}/get_weight_version answered {data!r}", url=self.url)
        return str(data["weight_version"])

    async def update_weight_version(
        self, version: str, *, abort_all_requests: bool = False
    ) -> None:
        """Set the server's weight version label without loading weights."""
        await self._checked(
            "/update_weight_version",
            {"new_version": version, "abort_all_requests": abort_all_requests},
        )

    # -- weight updates --------------------------------------------------------------------
    async def _checked(
        self, path: str, body: Mapping[str, Any], *, retry: bool = True
    ) -> dict[str, Any]:
        data = await self._json("POST", path, dict(body), retry=retry)
        if isinstance(data, dict) and data.get("success") is False:
            raise SGLangError(
                f"{self.url}{path} failed: {data.get('message', '')}", status=200, url=self.url
            )
        return data if isinstance(data, dict) else {}

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Load new weights from an HF-format directory on the server's disk."""
        return await self._checked(
            "/update_weights_from_disk",
            {
                "model_path": model_path,
                "load_format": load_format,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
            },
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Load weights from serialized tensors (one base64 payload per TP rank; CUDA IPC
        handles, so same host only)."""
        return await self._checked(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": list(serialized_named_tensors),
                "load_format": load_format,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            },
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        rendezvous_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Join the trainer's process group as rank ``rank_offset`` (the trainer is rank 0
        and hosts the rendezvous at ``master_address:master_port``); answers once every rank
        joined. ``rendezvous_timeout``: seconds the server waits for them, sent as
        ``timeout`` (``agentenv serve`` reads it; SGLang has no such field). Never retried:
        the server may have joined already."""
        body: dict[str, Any] = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        if rendezvous_timeout is not None:
            body["timeout"] = rendezvous_timeout
        return await self._checked("/init_weights_update_group", body, retry=False)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Receive one bucket of tensors that the trainer broadcasts, in this order, while
        this request waits; answers once they are installed. Never retried: a second
        request would wait for a broadcast that does not come."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ConfigError(
                f"names, dtypes and shapes must be aligned, got {len(names)}, {len(dtypes)} "
                f"and {len(shapes)}"
            )
        return await self._checked(
            "/update_weights_from_distributed",
            {
                "names": list(names),
                "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes],
                "group_name": group_name,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
            },
            retry=False,
        )

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> dict[str, Any]:
        """Leave the weight update group."""
        return await self._checked("/destroy_weights_update_group", {"group_name": group_name})

    # -- router ----------------------------------------------------------------------------
    async def add_worker(self, url: str) -> None:
        """Register a server with the router (``POST /workers``; older: ``/add_worker``)."""
        await _or_older(
            self._request("POST", "/workers", body={"url": url}),
            lambda: self._request("POST", "/add_worker", params={"url": url}),
        )

    async def remove_worker(self, url: str) -> bool:
        """Take a server out of the router (``DELETE /workers/{id}``; older:
        ``/remove_worker``); ``False`` if the router does not list it."""
        try:
            data = await self._json("GET", "/workers")
        except SGLangError as e:
            if e.status not in (404, 405):
                raise
            if url not in await self.list_workers():
                return False
            await self._request("POST", "/remove_worker", params={"url": url})
            return True
        items = data.get("workers", []) if isinstance(data, dict) else []
        ids = [w["id"] for w in items if isinstance(w, dict) and w.get("url") == url and "id" in w]
        for worker_id in ids:
            await self._request("DELETE", f"/workers/{worker_id}")
        return bool(ids)

    async def list_workers(self) -> list[str]:
        """The router's workers' URLs (``GET /workers``; older: ``/list_workers``)."""
        data = await _or_older(
            self._json("GET", "/workers"), lambda: self._json("GET", "/list_workers")
        )
        items = data.get("workers", data.get("urls", [])) if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise SGLangError(f"{self.url} answered an unknown worker list: {data!r}")
        return [str(w.get("url", w)) if isinstance(w, dict) else str(w) for w in items]


async def _or_older(current: Awaitable[T], older: Callable[[], Awaitable[T]]) -> T:
    """``current``'s answer, or ``older()``'s where the server lacks the route (404, or 405:
    a router that has the path for other methods only) -- an older SGLang or router."""
    try:
        return await current
    except SGLangError as e:
        if e.status not in (404, 405):
            raise
    return await older()


async def _lines(body: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The lines of a streamed body (of any length: aiohttp's ``readline`` bounds them)."""
    buf = bytearray()
    async for data in body.iter_any():
        start = len(buf)
        buf += data
        while (end := buf.find(b"\n", start)) >= 0:
            yield buf[:end].rstrip(b"\r").decode()
            del buf[: end + 1]
            start = 0
    if buf:
        yield buf.decode()


def _tags(tags: Sequence[str] | None) -> dict[str, Any]:
    return {} if tags is None else {"tags": list(tags)}


# -- parsing ---------------------------------------------------------------------------------
def _field(data: Mapping[str, Any], key: str, url: str) -> Any:
    if key not in data:
        raise SGLangError(f"the response from {url}/generate has no {key!r}: {str(data)[:300]}")
    return data[key]


def _logprobs(meta: Mapping[str, Any], url: str) -> list[tuple[float, int]]:
    entries = _field(meta, "output_token_logprobs", url)
    try:
        return [(float(e[0]), int(e[1])) for e in entries]
    except (TypeError, ValueError, IndexError):
        raise SGLangError(
            f"the response from {url}/generate has malformed output_token_logprobs"
        ) from None


def parse_completion(data: Any, return_logprob: bool, *, url: str = "") -> Completion:
    """A :class:`Completion` from one ``/generate`` response object (unknown keys ignored)."""
    if not isinstance(data, dict):
        raise SGLangError(f"the response from {url}/generate is not a JSON object: {data!r}")
    meta = _field(data, "meta_info", url)
    output_ids = [int(t) for t in _field(data, "output_ids", url)]
    logprobs = None
    if return_logprob:
        pairs = _logprobs(meta, url)
        if [t for _, t in pairs] != output_ids:
            raise SGLangError(
                f"the response from {url}/generate has output_token_logprobs for other "
                f"tokens than output_ids ({len(pairs)} vs {len(output_ids)})"
            )
        logprobs = [lp for lp, _ in pairs]
    try:
        finish = FinishReason.from_sglang(_field(meta, "finish_reason", url))
    except ConfigError as e:
        raise SGLangError(f"the response from {url}/generate: {e}") from None
    version = str(meta.get("weight_version", "default"))
    return Completion(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=finish,
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
    )


def _parse_chunk(data: Any, seen: int, return_logprob: bool, url: str) -> tuple[StreamChunk, int]:
    """One streamed event; ``seen`` is how many output tokens earlier events carried."""
    if not isinstance(data, dict):
        raise SGLangError(f"a streamed event from {url}/generate is not a JSON object")
    if "error" in data:
        raise SGLangError(f"the stream from {url}/generate failed: {data['error']}", url=url)
    meta = _field(data, "meta_info", url)
    ids = [int(t) for t in _field(data, "output_ids", url)]
    total = meta.get("completion_tokens")
    # SGLang streams cumulatively unless started with --incremental-streaming-output; the
    # running completion_tokens count tells which this server does.
    cumulative = len(ids) == total if isinstance(total, int) else len(ids) >= seen
    new_ids = ids[seen:] if cumulative else ids
    logprobs = None
    if return_logprob:
        pairs = _logprobs(meta, url)
        if len(pairs) == len(ids) and cumulative:
            pairs = pairs[seen:]
        elif len(pairs) > len(new_ids):
            pairs = pairs[-len(new_ids) :] if new_ids else []
        logprobs = [lp for lp, _ in pairs]
        if len(logprobs) != len(new_ids):
            raise SGLangError(
                f"a streamed event from {url}/generate has {len(logprobs)} logprobs for "
                f"{len(new_ids)} new tokens"
            )
    raw_finish = meta.get("finish_reason")
    finish = FinishReason.from_sglang(raw_finish) if raw_finish is not None else None
    chunk = StreamChunk(new_ids, logprobs, finish, str(meta.get("weight_version", "default")))
    return chunk, seen + len(new_ids)
