"""``agentenv serve``: the embedded engine behind SGLang's HTTP API.

    agentenv serve --model smollm2-135m [--host 127.0.0.1] [--port 30000] [--api-key KEY]
    agentenv eval --env arithmetic --model http://127.0.0.1:30000

Any SGLang client works against it (``/generate``, ``/health``, ``/abort_request``,
``/update_weights_from_disk``, ...), and so does an OpenAI client: it serves
``/v1/chat/completions`` and ``/v1/models`` as SGLang does (base URL
``http://HOST:PORT/v1``), and so does an Anthropic client: it serves ``/v1/messages``
(base URL ``http://HOST:PORT``). It binds to 127.0.0.1 unless told otherwise and runs
until Ctrl-C (or SIGTERM). With an API key (``--api-key``, or ``$AGENTENV_API_KEY``) every
request but ``/health*`` must send ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``,
as Anthropic clients do), as with SGLang's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, Literal

import anyio
import pydantic

from agentenv._http import MAX_BODY_BYTES
from agentenv.cli._config import add_command, add_model_arguments, build_config

__all__ = ["add_parser"]


class ServeConfig(pydantic.BaseModel):
    model: str = pydantic.Field(
        "smollm2-135m", description="a model name (smollm2-135m) or a local HF model directory"
    )
    host: str = pydantic.Field("127.0.0.1", description="interface to bind")
    port: int = pydantic.Field(30000, ge=0, le=65535, description="TCP port (0: any free one)")
    device: str = pydantic.Field("cpu", description="cpu, cuda or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] | None = pydantic.Field(
        None, description="default: float32 on CPU, bfloat16 on CUDA"
    )
    residual_dtype: Literal["float32", "bfloat16", "float16"] | None = pydantic.Field(
        None,
        description="embeddings, norms and residual stream (default: --dtype); "
        "--dtype bfloat16 --residual-dtype float32: an fp32 model under bf16 autocast",
    )
    max_running: int = pydantic.Field(128, ge=1, description="requests batched at once")
    context_length: int | None = pydantic.Field(
        None, ge=2, description="longest prompt + completion (default: the model's)"
    )
    max_total_tokens: int | None = pydantic.Field(
        None,
        ge=2,
        description="tokens the key/value pool holds, requests and prefix cache together "
        "(default: 8192 on CPU; on CUDA what --mem-fraction-static leaves)",
    )
    mem_fraction_static: float | None = pydantic.Field(
        None,
        gt=0,
        lt=1,
        description="CUDA: fraction of the GPU's memory for weights and key/value pool "
        "(default 0.88; memory in use at start counts against it)",
    )
    disable_radix_cache: bool = pydantic.Field(
        False, description="no prefix cache: every prompt is computed whole"
    )
    weight_version: str = pydantic.Field("default", description="initial weight version")
    cuda_graphs: bool = pydantic.Field(
        True, description="on CUDA, replay captured graphs for decode steps"
    )
    api_key: str | None = pydantic.Field(
        None,
        description="SGLang's --api-key: every request but /health* must send "
        "'Authorization: Bearer KEY' (default: $AGENTENV_API_KEY; none: no check)",
    )
    max_connections: int | None = pydantic.Field(
        None, ge=1, description="HTTP connections held at once (default: below the fd limit)"
    )
    max_prompts: int = pydantic.Field(
        4096, ge=1, description="prompts one /generate request may hold (a batch beyond: 400)"
    )
    max_body_bytes: int = pydantic.Field(
        MAX_BODY_BYTES,
        ge=1,
        description="bytes one request body may hold (beyond: 413, unread); chat messages "
        "that cannot fit the context are refused before they are tokenized",
    )


def add_parser(sub: Any) -> None:
    parser = add_command(sub, "serve", "serve a model over SGLang's HTTP API", __doc__)
    add_model_arguments(
        parser,
        ServeConfig,
        metavars={
            "model": "MODEL",
            "host": "HOST",
            "device": "DEVICE",
            "weight_version": "VERSION",
        },
    )
    parser.add_argument(  # SGLang's name: launchers can start either server
        "--model-path",
        dest="model",
        metavar="MODEL",
        default=argparse.SUPPRESS,
        help="same as --model",
    )
    parser.set_defaults(handler=run)


async def serve(cfg: ServeConfig) -> None:
    import torch

    from agentenv._http import Router, raise_open_file_limit
    from agentenv._tokenizer import ChatTokenizer
    from agentenv.endpoint import serve_chat
    from agentenv.engine import Engine, EngineServer

    raise_open_file_limit()  # as SGLang: room for thousands of concurrent clients
    api_key = cfg.api_key or os.environ.get("AGENTENV_API_KEY") or None

    dtype = None if cfg.dtype is None else getattr(torch, cfg.dtype)
    residual = None if cfg.residual_dtype is None else getattr(torch, cfg.residual_dtype)
    engine = Engine(
        cfg.model,
        device=cfg.device,
        dtype=dtype,
        residual_dtype=residual,
        max_running=cfg.max_running,
        context_length=cfg.context_length,
        weight_version=cfg.weight_version,
        cuda_graphs=cfg.cuda_graphs,
        max_total_tokens=cfg.max_total_tokens,
        mem_fraction_static=cfg.mem_fraction_static,
        prefix_cache=not cfg.disable_radix_cache,
    )
    tokenizer = await anyio.to_thread.run_sync(ChatTokenizer.load, str(engine.model_path))
    name = Path(engine.model_path).name

    def openai_routes(router: Router) -> None:  # OpenAI's /v1 routes, as SGLang serves them
        serve_chat(router, engine, tokenizer, model=name, context_length=engine.context_length)

    server = EngineServer(
        engine,
        extra_routes=openai_routes,
        host=cfg.host,
        port=cfg.port,
        api_key=api_key,
        max_connections=cfg.max_connections,
        max_prompts=cfg.max_prompts,
        max_body_bytes=cfg.max_body_bytes,
    )
    async with engine, server:
        auth = "API key required" if api_key else "no API key"
        print(
            f"agentenv serve: {cfg.model} on {cfg.device} at {server.url} ({auth}; Ctrl-C stops)",
            file=sys.stderr,
            flush=True,
        )
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break


def run(args: argparse.Namespace) -> int:
    cfg = build_config(ServeConfig, args)
    anyio.run(serve, cfg)
    return 0
