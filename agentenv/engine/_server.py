"""The embedded engine behind SGLang's native HTTP API (``agentenv serve``).

Same routes, request fields, response shapes and error messages as an SGLang server
(see ``shared/reference/sglang-protocol.md``), so :class:`~agentenv.sglang.SGLangClient`
and any other SGLang client talk to it unchanged::

    POST /generate                 single, batch (a list of input_ids lists), or streamed
    GET  /health, /health_generate
    GET  /get_model_info, /model_info, /get_server_info, /server_info, /get_weight_version
    POST /abort_request            {"rid"} or {"abort_all": true}: 200, unknown rid a no-op
    POST /pause_generation         {"mode": "abort" | "retract" | "in_place"}
    POST /continue_generation
    POST /flush_cache              (GET too) 400 while requests run
    POST /update_weights_from_disk {"model_path", "weight_version", ...}
    POST /update_weight_version    {"new_version"}

Errors are HTTP 400 ``{"error": {"message": ...}}`` naming the field, as SGLang answers.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio

from agentenv._errors import AgentEnvError, ConfigError
from agentenv._generator import FinishReason, SamplingParams
from agentenv._http import HTTPError, HTTPServer, Request, Response, Router, StreamingResponse, sse
from agentenv.engine._engine import Engine

__all__ = ["EngineServer"]


def _body(request: Request) -> dict[str, Any]:
    if not request.body:
        return {}
    try:
        data = json.loads(request.body)
    except ValueError as e:
        raise HTTPError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return data


def _failure(message: str) -> Response:
    return Response.json({"success": False, "message": message}, status=400)


def _bad(message: str) -> HTTPError:
    return HTTPError(400, message, type="BadRequest")


class EngineServer:
    """Serves ``engine`` over HTTP; an async context manager (``.url`` inside).

    Args:
        engine: a started :class:`Engine` (inside its ``async with``).
        host: interface to bind; the default serves this machine only.
        port: TCP port; 0 picks a free one.
    """

    def __init__(self, engine: Engine, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
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
            ("POST", "/abort_request", self._abort, False),
            ("POST", "/pause_generation", self._pause, True),
            ("POST", "/continue_generation", self._continue, False),
            ("POST", "/flush_cache", self._flush, False),
            ("GET", "/flush_cache", self._flush, False),
            ("POST", "/update_weights_from_disk", self._update_from_disk, True),
            ("POST", "/update_weight_version", self._update_version, False),
        ]
        for method, path, handler, long_poll in routes:
            router.add(method, path, handler, long_poll=long_poll)
        self._http = HTTPServer(router, host=host, port=port)

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def port(self) -> int:
        return self._http.port

    async def __aenter__(self) -> EngineServer:
        await self._http.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.__aexit__(*exc)

    # -- generation ------------------------------------------------------------------------
    def _prompt(self, data: Mapping[str, Any]) -> tuple[list[list[int]], bool]:
        """The prompts as id lists, and whether the request was a batch."""
        ids = data.get("input_ids")
        if ids is None:
            text = data.get("text")
            if text is None:
                raise _bad("Either text or input_ids should be provided.")
            texts = text if isinstance(text, list) else [text]
            if not all(isinstance(t, str) for t in texts):
                raise _bad("text must be a string or a list of strings")
            encoded = [self.engine.tokenizer.encode(t).ids for t in texts]
            return encoded, isinstance(text, list)
        if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
            return ids, True
        if not isinstance(ids, list):
            raise _bad("input_ids must be a list of token ids or a list of such lists")
        return [ids], False

    async def _generate(self, request: Request) -> Response | StreamingResponse:
        data = _body(request)
        prompts, batch = self._prompt(data)
        if any(not p for p in prompts):
            raise _bad("input_ids cannot be empty.")
        try:
            params = SamplingParams.from_sglang(data.get("sampling_params"))
        except ConfigError as e:
            raise _bad(str(e).rstrip(".") + ".") from None
        logprob = bool(data.get("return_logprob", False))
        rid = data.get("rid")
        if batch:
            if isinstance(rid, list):
                if len(rid) != len(prompts):
                    raise _bad(
                        "The specified rids length mismatch with the batch_size for batch "
                        "processing."
                    )
                rids: list[str | None] = [str(r) for r in rid]
            else:
                rids = [f"{rid}_{i}" if rid else None for i in range(len(prompts))]
        else:
            rids = [str(rid) if rid is not None else None]
        if data.get("stream"):
            if batch:
                raise _bad("streaming a batch is not supported by this server; send one prompt")
            return StreamingResponse(self._stream(prompts[0], params, rids[0], logprob))
        results: list[Any] = [None] * len(prompts)

        async def one(i: int) -> None:
            results[i] = await self._one(prompts[i], params, rids[i], logprob)

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        except* AgentEnvError as group:
            raise _bad(str(group.exceptions[0])) from None
        return Response.json(results if batch else results[0])

    async def _one(
        self, ids: list[int], params: SamplingParams, rid: str | None, logprob: bool
    ) -> dict[str, Any]:
        start = time.perf_counter()
        c = await self.engine.generate(ids, params, rid=rid, return_logprob=logprob)
        return self._response(
            rid,
            ids,
            c.output_ids,
            c.logprobs,
            c.finish_reason,
            c.weight_version,
            start,
            c.cached_tokens,
        )

    def _response(
        self,
        rid: str | None,
        prompt: list[int],
        output: list[int],
        logprobs: list[float] | None,
        finish: FinishReason | None,
        version: str,
        start: float,
        cached: int = 0,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": None if finish is None else finish.to_sglang(),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output),
            "cached_tokens": cached,
            "weight_version": version,
            "e2e_latency": round(time.perf_counter() - start, 6),
        }
        if logprobs is not None:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(logprobs, output, strict=True)
            ]
            meta["input_token_logprobs"] = []
        return {
            "text": self.engine.tokenizer.decode(output, skip_special_tokens=False),
            "output_ids": output,
            "meta_info": meta,
        }

    async def _stream(
        self, ids: list[int], params: SamplingParams, rid: str | None, logprob: bool
    ) -> AsyncIterator[bytes]:
        start = time.perf_counter()
        output: list[int] = []
        lps: list[float] = []
        try:
            # SGLang's default: every event carries the whole output so far.
            async for chunk in self.engine.stream(ids, params, rid=rid):
                output.extend(chunk.output_ids)
                lps.extend(chunk.logprobs)
                event = self._response(
                    rid,
                    ids,
                    output,
                    lps if logprob else None,
                    chunk.finish_reason,
                    chunk.weight_version,
                    start,
                    chunk.cached_tokens,
                )
                yield sse(json.dumps(event, separators=(",", ":")))
        except AgentEnvError as e:  # after the 200 went out: an error event, as SGLang
            yield sse(json.dumps({"error": {"message": str(e)}}))
        yield sse("[DONE]")

    # -- control ---------------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
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
                "device": e.device,
                "dtype": str(e.dtype).removeprefix("torch."),
                "weight_version": e.weight_version,
                "version": f"agentenv-{version('agentenv')}",
            }
        )

    async def _weight_version(self, request: Request) -> Response:
        return Response.json({"weight_version": self.engine.weight_version})

    async def _abort(self, request: Request) -> Response:
        data = _body(request)
        if data.get("abort_all"):
            self.engine.abort(all=True)
        elif data.get("rid"):
            self.engine.abort(str(data["rid"]))
        return Response.empty(200)

    async def _pause(self, request: Request) -> Response:
        mode = _body(request).get("mode", "abort")
        try:
            await self.engine.pause(mode)
        except ConfigError as e:
            raise _bad(str(e)) from None
        return Response.json({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: Request) -> Response:
        await self.engine.resume()
        return Response.json({"message": "Generation continued successfully.", "status": "ok"})

    async def _flush(self, request: Request) -> Response:
        if self.engine.running:
            raise _bad(
                f"Cache not flushed because there are pending requests. "
                f"#queue-req: {self.engine.running}"
            )
        return Response.text("Cache flushed.\nPlease check backend logs for more details.")

    async def _update_from_disk(self, request: Request) -> Response:
        data = _body(request)
        path = data.get("model_path")
        if not isinstance(path, str) or not path:
            return Response.json(
                {"success": False, "message": "model_path is required"}, status=400
            )
        version = data.get("weight_version")
        if data.get("abort_all_requests"):
            self.engine.abort(all=True)
        try:
            await self.engine.update_weights_from_disk(
                path, weight_version=None if version is None else str(version)
            )
        except (AgentEnvError, OSError) as e:
            return _failure(f"Failed to update weights: {e}")
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return Response.json({"success": True, "message": message, "num_paused_requests": 0})

    async def _update_version(self, request: Request) -> Response:
        data = _body(request)
        version = data.get("new_version")
        if version is None:
            return Response.json(
                {
                    "success": False,
                    "message": "Failed to update weight version: new_version is required",
                },
                status=400,
            )
        if data.get("abort_all_requests", True):
            self.engine.abort(all=True)
        self.engine.weight_version = str(version)
        return Response.json(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": str(version),
            }
        )
