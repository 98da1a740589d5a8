"""The embedded engine behind SGLang's native HTTP API (``agentenv serve``).

Same routes, request fields, response shapes and error messages as an SGLang server
(``shared/reference/sglang-protocol.md``), so :class:`~agentenv.sglang.SGLangClient` and
any other SGLang client talk to it unchanged: ``/generate`` (single, batch, streamed), the
health, info and load routes, abort, pause and continue, ``/flush_cache``, the weight
updates (disk, tensor, distributed) and the memory release for colocated training, and,
when ``extra_routes`` adds them (``agentenv serve`` does), OpenAI's and Anthropic's chat
APIs (:func:`agentenv.endpoint.serve_chat`). docs/inference.md lists the routes and the
rules of each; the request fields are the schemas of :mod:`agentenv.engine._requests`.

Every body is checked against its schema before the engine sees it: a bad one is answered
400 ``{"error": {"message": ...}}`` naming the field, the value and what is expected, a
refused weight update ``{"success": false, "message": ...}`` with 400, and a request that
fails inside the engine anyway 500, alone. The distributed update's failure handling (the
trainer is rank 0 of a group of its own, this server rank ``rank_offset``, see
:mod:`agentenv.engine._group`) is in docs/trainer.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import torch

from agentenv._errors import (
    AgentEnvError,
    ClosedResourceError,
    ConfigError,
    ContextLengthError,
    GenerationError,
)
from agentenv._generator import Completion, SamplingParams
from agentenv._http import (
    MAX_BODY_BYTES,
    HTTPError,
    HTTPServer,
    Request,
    Response,
    Router,
    StreamingResponse,
    api_key_guard,
    sse,
    warn_if_open,
)
from agentenv._text_bound import text_bound
from agentenv.engine._engine import Engine, EngineChunk
from agentenv.engine._group import WeightUpdateGroup, join_within, parse_dtype
from agentenv.engine._ipc import describe_named_tensors
from agentenv.engine._model import weight_mismatch
from agentenv.engine._requests import (
    MAX_PROMPTS,
    AbortBody,
    Body,
    DestroyGroupBody,
    GenerateBody,
    InitGroupBody,
    MemoryBody,
    PauseBody,
    UpdateFromDiskBody,
    UpdateFromDistributedBody,
    UpdateFromTensorBody,
    UpdateVersionBody,
    parse,
)

__all__ = ["EngineServer"]


def _failure(message: str) -> Response:
    return Response.json({"success": False, "message": message}, status=400)


def _updated(message: str, version: str | None, **more: Any) -> Response:
    """A weight update's success, as SGLang answers it."""
    if version is not None:
        message += f" Weight version updated to {version}."
    return Response.json({"success": True, "message": message, **more})


Handler = Callable[["EngineServer", Request], Awaitable[Response]]


def _weight_route(prefix: str) -> Callable[[Handler], Handler]:
    """A weight route answers its refusals as SGLang does: ``{"success": false,
    "message": prefix + reason}`` with 400, for every AgentEnvError but a closed engine's."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def answer(self: EngineServer, request: Request) -> Response:
            try:
                return await handler(self, request)
            except ClosedResourceError:
                raise
            except AgentEnvError as e:
                return _failure(f"{prefix}{e}")

        return answer

    return wrap


def _bad(message: str) -> HTTPError:
    return HTTPError(400, message, type="BadRequest")


@dataclasses.dataclass(eq=False)
class _ServedGroup:
    """A weight update group this server joined: buckets are received one at a time."""

    group: WeightUpdateGroup
    device: str  # where received tensors land (CPU for gloo)
    lock: anyio.Lock = dataclasses.field(default_factory=anyio.Lock)
    destroyed: bool = False


B = TypeVar("B", bound=Body)


def _parse(schema: type[B], request: Request, **context: Any) -> B:
    """The body checked against its schema; 400 naming the field otherwise."""
    try:
        return parse(schema, request, **context)
    except ConfigError as e:
        raise _bad(str(e)) from None


def _status(error: AgentEnvError) -> HTTPError:
    """The answer to a generation that failed with ``error``."""
    if isinstance(error, ClosedResourceError):
        return HTTPError(503, f"{error}; the server is shutting down", type="ServiceUnavailable")
    if isinstance(error, GenerationError):  # the engine failed on it, not the request
        return HTTPError(500, str(error), type="InternalServerError")
    return _bad(str(error).rstrip(".") + ".")


def _bucket(body: UpdateFromDistributedBody) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``/update_weights_from_distributed``'s tensors: (name, dtype, shape) in order."""
    names, dtypes, shapes = body.names, body.dtypes, body.shapes
    if not len(names) == len(dtypes) == len(shapes):
        raise ConfigError(
            f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, "
            f"{len(dtypes)} and {len(shapes)}"
        )
    out = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not name:
            raise ConfigError(f"names[{i}] must be a weight name, got {name!r}")
        try:
            parsed = parse_dtype(dtype)
        except ConfigError as e:
            raise ConfigError(f"dtypes[{i}]: {e}") from None
        if not all(d >= 0 for d in shape):
            raise ConfigError(f"shapes[{i}] must be a list of non-negative ints, got {shape!r}")
        out.append((name, parsed, tuple(shape)))
    return out


def _receive(
    served: _ServedGroup, bucket: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> list[torch.Tensor]:
    device = torch.device(served.device)
    if device.type == "cuda" and device.index is not None:
        # A worker thread starts on GPU 0: NCCL would make a context there (the trainer's
        # GPU, typically) and run its kernels from it.
        torch.cuda.set_device(device)
    tensors = [torch.empty(shape, dtype=dtype, device=device) for _, dtype, shape in bucket]
    served.group.broadcast(tensors)
    return tensors


class EngineServer:
    """Serves ``engine`` over HTTP; an async context manager (``.url`` inside).

    Args:
        engine: a started :class:`Engine` (inside its ``async with``).
        host: interface to bind; the default serves this machine only.
        port: TCP port; 0 picks a free one.
        api_key: SGLang's ``--api-key``: every request but the health probes
            (``/health``, ``/health_generate``) must carry ``Authorization: Bearer <key>``
            (or ``X-API-Key: <key>``), else 401. Without one, a server bound to a
            non-loopback address logs a warning at start.
        max_connections: connections held at once (default: below the descriptor limit);
            see :class:`~agentenv.http.HTTPServer`.
        max_prompts: prompts one ``/generate`` request may hold (a batch beyond it is
            answered 400 naming the limit).
        extra_routes: adds more routes to the server's router (``agentenv serve`` adds OpenAI's
            ``/v1`` routes with :func:`agentenv.endpoint.serve_chat`).
        max_body_bytes: a request body, at most (413 beyond, before it is read).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_connections: int | None = None,
        max_prompts: int = MAX_PROMPTS,
        extra_routes: Callable[[Router], None] | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if max_prompts < 1:
            raise ConfigError(f"max_prompts must be at least 1, got {max_prompts}")
        self.engine = engine
        self.max_prompts = max_prompts
        router = Router()
        routes: list[tuple[str, str, Any, bool]] = [
            ("POST", "/generate", self._generate, True),
            ("GET", "/health", self._health, False),
            ("GET", "/health_generate", self._health, False),
            ("GET", "/get_model_info", self._model_info, False),
            ("GET", "/model_info", self._model_info, False),
            ("GET", "/get_server_info", self._server_info, False),
            ("GET", "/server_info", self._server_info, False),
            ("GET", "/get_weight_version", self._weight_version, False),
            ("GET", "/get_load", self._load, False),
            ("POST", "/abort_request", self._abort, False),
            ("POST", "/pause_generation", self._pause, True),
            ("POST", "/continue_generation", self._continue, False),
            ("POST", "/flush_cache", self._flush, False),
            ("GET", "/flush_cache", self._flush, False),
            ("POST", "/update_weights_from_disk", self._update_from_disk, True),
            ("POST", "/update_weight_version", self._update_version, False),
            ("POST", "/init_weights_update_group", self._init_group, False),
            ("POST", "/update_weights_from_distributed", self._update_from_distributed, False),
            ("POST", "/destroy_weights_update_group", self._destroy_group, False),
            ("POST", "/update_weights_from_tensor", self._update_from_tensor, True),
            ("POST", "/release_memory_occupation", self._release_memory, True),
            ("GET", "/release_memory_occupation", self._release_memory, True),
            ("POST", "/resume_memory_occupation", self._resume_memory, True),
            ("GET", "/resume_memory_occupation", self._resume_memory, True),
        ]
        for method, path, handler, long_poll in routes:
            probe = path.startswith("/health")  # answered even when every connection is busy
            router.add(method, path, handler, long_poll=long_poll, probe=probe)
        if extra_routes is not None:
            extra_routes(router)
        guard = None
        if api_key is not None:
            guard = api_key_guard(
                api_key, exempt=lambda path: path.startswith("/health"), hint="--api-key"
            )
        self.api_key = api_key
        self._http = HTTPServer(
            router,
            host=host,
            port=port,
            guard=guard,
            max_connections=max_connections,
            max_body_bytes=max_body_bytes,
            hints={"max_body_bytes": "agentenv serve --max-body-bytes raises the limit"},
        )
        self._groups: dict[str, _ServedGroup] = {}
        self._forming: set[str] = set()  # groups whose rendezvous is under way
        # (A stand-in tokenizer, not a tokenizers.Tokenizer, proves no bound.)
        tok = engine.tokenizer
        self._text_bound = text_bound(tok) if hasattr(tok, "to_str") else None

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def http_server(self) -> HTTPServer:
        """The :class:`~agentenv.http.HTTPServer` serving the routes (its router, guard and
        limits: to serve them elsewhere)."""
        return self._http

    async def __aenter__(self) -> EngineServer:
        await self._http.__aenter__()
        if self.api_key is None:
            warn_if_open(self._http.host, self.port, what="agentenv serve")
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self._http.__aexit__(*exc)
        finally:
            with anyio.CancelScope(shield=True):
                for name in list(self._groups):
                    await self._leave(name)

    # -- generation ------------------------------------------------------------------------
    def _prompts(self, body: GenerateBody) -> list[list[int]]:
        """The prompts as id lists (one, or the batch's)."""
        if body.input_ids is not None:
            ids = body.input_ids
            return ids if body.batch else [ids]  # type: ignore[list-item,return-value]
        texts = body.text if isinstance(body.text, list) else [body.text or ""]
        # A text that cannot fit the context is refused before it is tokenized.
        room, bound = self.engine.context_length - 1, self._text_bound
        for t in texts:
            if bound is not None and not bound.may_fit(t, room):
                raise _bad(
                    f"The input (at least {bound.fewest_tokens(t)} tokens, {len(t)} "
                    "characters) is longer than the model's context length "
                    f"({self.engine.context_length} tokens)."
                )
        try:
            encoded = [self.engine.tokenizer.encode(t).ids for t in texts]
        except Exception as e:  # e.g. a lone surrogate, which JSON can carry
            raise _bad(f"text could not be tokenized: {type(e).__name__}: {e}"[:300]) from None
        if any(not p for p in encoded):
            raise _bad("input_ids cannot be empty.")
        return encoded

    def _rids(self, body: GenerateBody, n: int) -> list[str | None]:
        rid = body.rid
        if not body.batch:
            if isinstance(rid, list):
                raise _bad(f"rid must be a string for a single prompt, got {rid!r}"[:200])
            return [rid]
        if isinstance(rid, list):
            if len(rid) != n:
                raise _bad(
                    "The specified rids length mismatch with the batch_size for batch processing."
                )
            return list(rid)
        return [f"{rid}_{i}" if rid else None for i in range(n)]

    async def _generate(self, request: Request) -> Response | StreamingResponse:
        # Everything is checked before anything runs: the engine sees valid requests only.
        body = _parse(
            GenerateBody, request, vocab=self.engine.vocab_size, max_prompts=self.max_prompts
        )
        try:
            params = body.params()
        except ConfigError as e:
            raise _bad(str(e).rstrip(".") + ".") from None
        if self.engine.released:
            raise _bad(
                f"The engine's memory is released ({', '.join(sorted(self.engine.released))}) "
                "for training; POST /resume_memory_occupation before generating."
            )
        prompts = self._prompts(body)
        rids = self._rids(body, len(prompts))
        for prompt in prompts:
            try:
                self.engine.check(prompt, params)
            except (ConfigError, ContextLengthError) as e:
                raise _status(e) from None
        logprob = body.return_logprob
        skip = bool(body.sampling_params and body.sampling_params.skip_special_tokens)
        if body.stream:
            if body.batch:
                raise _bad("streaming a batch is not supported by this server; send one prompt")
            return StreamingResponse(self._stream(prompts[0], params, rids[0], logprob, skip))
        results: list[Any] = [None] * len(prompts)
        errors: list[AgentEnvError] = []

        async def one(i: int, scope: anyio.CancelScope) -> None:
            start = time.perf_counter()
            try:
                c = await self.engine.generate(
                    prompts[i], params, rid=rids[i], return_logprob=logprob
                )
                results[i] = self._response(rids[i], prompts[i], c, start, skip, logprob)
            except AgentEnvError as e:  # the batch fails with its first error
                errors.append(e)
                scope.cancel()

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i, tg.cancel_scope)
        if errors:
            raise _status(errors[0])
        return Response.json(results if body.batch else results[0])

    def _response(
        self,
        rid: str | None,
        prompt: list[int],
        c: Completion | EngineChunk,
        start: float,
        skip_special_tokens: bool,
        logprob: bool,
    ) -> dict[str, Any]:
        """SGLang's answer for ``c``, the whole output so far."""
        finish, output = c.finish_reason, c.output_ids
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": None if finish is None else finish.to_sglang(),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output),
            "cached_tokens": c.cached_tokens,
            "weight_version": c.weight_version,
            "e2e_latency": round(time.perf_counter() - start, 6),
        }
        if logprob and c.logprobs is not None:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(c.logprobs, output, strict=True)
            ]
            meta["input_token_logprobs"] = []
        return {
            "text": self.engine.tokenizer.decode(output, skip_special_tokens=skip_special_tokens),
            "output_ids": output,
            "meta_info": meta,
        }

    async def _stream(
        self, ids: list[int], params: SamplingParams, rid: str | None, logprob: bool, skip: bool
    ) -> AsyncIterator[bytes]:
        start = time.perf_counter()
        output: list[int] = []
        lps: list[float] = []
        try:
            # SGLang's default: every event carries the whole output so far.
            async for chunk in self.engine.stream(ids, params, rid=rid):
                output.extend(chunk.output_ids)
                lps.extend(chunk.logprobs)
                sofar = dataclasses.replace(chunk, output_ids=output, logprobs=lps)
                event = self._response(rid, ids, sofar, start, skip, logprob)
                yield sse(json.dumps(event, separators=(",", ":")))
        except AgentEnvError as e:  # after the 200 went out: an error event, as SGLang
            yield sse(json.dumps({"error": {"message": str(e)}}))
        yield sse("[DONE]")

    # -- control ---------------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
        if not self.engine.healthy:
            raise HTTPError(503, "the engine is not running", type="ServiceUnavailable")
        return Response.empty(200)

    async def _model_info(self, request: Request) -> Response:
        path = str(self.engine.model_path)
        return Response.json(
            {
                "model_path": path,
                "tokenizer_path": path,
                "is_generation": True,
                "weight_version": self.engine.weight_version,
                "preferred_sampling_params": None,
            }
        )

    async def _server_info(self, request: Request) -> Response:
        from importlib.metadata import version

        e = self.engine
        return Response.json(
            {
                "model_path": str(e.model_path),
                "context_length": e.context_length,
                "max_running_requests": e.max_running,
                "max_total_num_tokens": e.max_total_tokens,
                "disable_radix_cache": not e.prefix_cache,
                "device": e.device,
                "dtype": str(e.dtype).removeprefix("torch."),
                "weight_version": e.weight_version,
                "version": f"agentenv-{version('agentenv')}",
            }
        )

    async def _load(self, request: Request) -> Response:
        e = self.engine
        return Response.json([{"dp_rank": 0, "num_reqs": e.running, "num_waiting_reqs": e.waiting}])

    async def _weight_version(self, request: Request) -> Response:
        return Response.json({"weight_version": self.engine.weight_version})

    async def _abort(self, request: Request) -> Response:
        body = _parse(AbortBody, request)
        if body.abort_all:
            self.engine.abort(all=True)
        elif body.rid:
            self.engine.abort(body.rid)
        return Response.empty(200)

    async def _pause(self, request: Request) -> Response:
        await self.engine.pause(_parse(PauseBody, request).mode)
        return Response.json({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: Request) -> Response:
        await self.engine.resume()
        return Response.json({"message": "Generation continued successfully.", "status": "ok"})

    async def _flush(self, request: Request) -> Response:
        if not await self.engine.flush_cache():
            raise _bad(
                f"Cache not flushed because there are pending requests. "
                f"#queue-req: {self.engine.running}"
            )
        return Response.text("Cache flushed.\nPlease check backend logs for more details.")

    @_weight_route("Failed to update weights: ")
    async def _update_from_disk(self, request: Request) -> Response:
        body = parse(UpdateFromDiskBody, request)
        if body.abort_all_requests:
            self.engine.abort(all=True)
        version = body.weight_version
        try:
            await self.engine.update_weights_from_disk(body.model_path, weight_version=version)
        except AgentEnvError:
            raise
        except Exception as e:  # unreadable, corrupt or foreign files: the model is unchanged
            return _failure(f"Failed to update weights: {type(e).__name__}: {e}")
        return _updated("Succeeded to update model weights.", version, num_paused_requests=0)

    @_weight_route("Failed to update weights: ")
    async def _update_from_tensor(self, request: Request) -> Response:
        """SGLang's same-machine handover (:mod:`agentenv.engine._ipc`): the payload is
        checked whole, then read (CPU) or mapped (CUDA), then installed at once; a payload
        refused at any step leaves the model as it was. The sender keeps its tensors alive
        until this answers."""
        body = parse(UpdateFromTensorBody, request)
        cuda = self.engine.device.startswith("cuda")
        describe = functools.partial(
            describe_named_tensors, body.serialized_named_tensors[0], cuda=cuda
        )
        payload = await anyio.to_thread.run_sync(describe)  # a large pickle takes a while
        problem = weight_mismatch(payload.shapes, self.engine.weight_shapes())
        if problem is not None:
            raise ConfigError(f"{problem}; the model is unchanged")
        tensors = await anyio.to_thread.run_sync(payload.materialise)
        if body.abort_all_requests:
            self.engine.abort(all=True)
        version = body.weight_version
        try:
            await self.engine.update_weights(tensors, weight_version=version, partial=True)
        finally:
            tensors.clear()  # CUDA: the sender's memory is its own again
        return _updated("Succeeded to update model weights.", version)

    @_weight_route("Failed to update weight version: ")
    async def _update_version(self, request: Request) -> Response:
        body = parse(UpdateVersionBody, request)
        if body.abort_all_requests:
            self.engine.abort(all=True)
        version = self.engine.weight_version = body.new_version
        return Response.json(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": version,
            }
        )

    # -- colocated training: memory given back and taken again ----------------------------
    async def _release_memory(self, request: Request) -> Response:
        tags = _parse(MemoryBody, request).tags
        try:
            await self.engine.release_memory(tags)
        except ConfigError as e:
            raise _bad(str(e)) from None
        return Response.json(None)

    async def _resume_memory(self, request: Request) -> Response:
        await self.engine.resume_memory(_parse(MemoryBody, request).tags)
        return Response.json(None)

    # -- distributed weight updates --------------------------------------------------------
    @_weight_route("Failed to initialize custom process group: ")
    async def _init_group(self, request: Request) -> Response:
        body = parse(InitGroupBody, request)
        name, backend, device = body.group_name, body.backend, self.engine.device
        if name in self._groups or name in self._forming:
            raise ConfigError(
                f"group {name!r} already exists on this server; destroy it first "
                "(/destroy_weights_update_group) or use another group_name"
            )
        if backend == "nccl" and not device.startswith("cuda"):
            raise ConfigError(
                f"backend nccl needs the engine on a CUDA device, this server runs on "
                f"{device} (use backend gloo)"
            )
        self._forming.add(name)
        try:
            # Over within the timeout and cancellable (the server stops while a rank is
            # missing): a join abandoned so destroys the group if it forms after all.
            group = await join_within(
                body.master_address, body.master_port, rank=body.rank_offset,
                world_size=body.world_size, name=name, backend=backend, timeout=body.timeout,
            )  # fmt: skip
            self._groups[name] = _ServedGroup(group, device if backend == "nccl" else "cpu")
        except TimeoutError as e:
            raise ConfigError(str(e)) from None
        finally:
            self._forming.discard(name)
        return Response.json(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    @_weight_route("Failed to update weights: ")
    async def _update_from_distributed(self, request: Request) -> Response:
        body = parse(UpdateFromDistributedBody, request)  # refused: nothing is received
        name = body.group_name
        served = self._groups.get(name)
        if served is None:
            raise ConfigError(
                f"group {name!r} is not one of this server's weight update groups "
                f"{sorted(self._groups)}; call /init_weights_update_group first"
            )
        bucket = _bucket(body)
        # Checked now, refused after the bucket is received: the trainer is broadcasting it.
        problem = weight_mismatch({n: shape for n, _, shape in bucket}, self.engine.weight_shapes())
        if body.abort_all_requests:
            self.engine.abort(all=True)
        async with served.lock:
            if served.destroyed:
                raise ConfigError(f"group {name!r} was destroyed")
            try:
                tensors = await anyio.to_thread.run_sync(_receive, served, bucket)
            except (RuntimeError, ConfigError) as e:
                raise ConfigError(
                    f"receiving the bucket over group {name!r} failed: {e}. Destroy the "
                    "group and initialise a new one."
                ) from None
            finally:
                if served.destroyed:  # destroyed while receiving (gloo: not ended by the abort)
                    await anyio.to_thread.run_sync(served.group.destroy)
        if problem is not None:
            raise ConfigError(
                f"{problem}; the bucket was received and dropped, the model is unchanged"
            )
        version = body.weight_version
        await self.engine.update_weights(
            {n: t for (n, _, _), t in zip(bucket, tensors, strict=True)},
            weight_version=version,
            partial=True,
        )
        return _updated("Succeeded to update parameter online from distributed.", version)

    @_weight_route("Failed to destroy the group: ")
    async def _destroy_group(self, request: Request) -> Response:
        name = parse(DestroyGroupBody, request).group_name
        if name not in self._groups:
            return _failure(f"The group to be destroyed does not exist: {name!r}.")
        await self._leave(name)
        return Response.json(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    async def _leave(self, name: str) -> None:
        served = self._groups.pop(name)
        served.destroyed = True
        if served.lock.locked():
            # A bucket is being received: abort it (NCCL: at once; gloo cannot be
            # interrupted and ends when the trainer sends or leaves). The request fails.
            await anyio.to_thread.run_sync(served.group.abort)
        else:
            await anyio.to_thread.run_sync(served.group.destroy)
