"""The rollout engines of a training run (``config.engine``), each a
:class:`~trainer.RolloutEngine`: the embedded engine, ``agentenv serve`` / SGLang servers
launched for the run or already running, or engine actors on Ray; and how the trainer's
weights reach them."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from trainer._resources import free_port
from trainer.run._reporting import say

if TYPE_CHECKING:
    import torch

    from agentenv import Tokenizer
    from agentenv.sglang import SGLangClient
    from trainer.backends import Backend
    from trainer.distributed import EngineGroup, EngineSpec, Placed, RolloutWorkers
    from trainer.engines import RolloutEngine, WeightSync
    from trainer.run._config import TrainConfig

__all__ = [
    "engine_dtypes",
    "engine_spec",
    "rollout_engine",
    "rollout_workers",
    "serve_args",
    "server_capacity",
    "server_sync",
]


@contextlib.asynccontextmanager
async def rollout_engine(
    config: TrainConfig,
    tokenizer: Tokenizer,
    weights_dir: Path,
    dtypes: tuple[torch.dtype, torch.dtype] | None = None,
    placed: Placed | None = None,
) -> AsyncIterator[RolloutEngine]:
    """The engines that play the episodes, the trainer's weights reaching them through
    ``--weight-sync`` (in-process into the embedded engine).

    ``dtypes``: the embedded or ``serve`` engine's ``(dtype, residual_dtype)``, those of the
    trainer's numerics (:func:`engine_dtypes`); default: the engine's own. ``placed``: the
    run's Ray placement (:class:`trainer.distributed.Placed`); with engine bundles in it
    (``--rollout-num-gpus``) the engines are Ray actors behind SGLang's router."""
    from agentenv.engine import Engine, resolve_model
    from agentenv.sglang import Launcher, SGLangClient, server_command
    from trainer.engines import EmbeddedEngine, ServerEngine

    engine = config.engine
    device = engine.rollout_device or config.model.device
    dtype, residual_dtype = dtypes or (None, None)
    api_key = engine.api_key()
    if placed is not None and placed.engines:
        async with _engine_actors(config, placed, weights_dir, dtypes) as group:
            yield group
    elif engine.rollout_url is not None:
        async with SGLangClient(engine.rollout_url, api_key=api_key) as client:
            await client.wait_healthy(timeout=60.0)
            async with server_sync(config, client, weights_dir) as sync:
                yield ServerEngine(client, sync, capacity=await server_capacity(config, client))
    elif engine.rollout_engine == "embedded":
        async with Engine(
            config.model.hf_checkpoint, device=device, dtype=dtype,
            residual_dtype=residual_dtype, tokenizer=tokenizer,
            max_running=engine.rollout_max_running,
        ) as embedded:  # fmt: skip
            yield EmbeddedEngine(embedded)
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        model = str(resolve_model(config.model.hf_checkpoint))
        if engine.rollout_engine == "serve":
            program = [sys.executable, "-m", "agentenv", "serve"]
            extra = serve_args(config, device, dtypes)
            command = server_command(model, port=port, program=program, extra=extra)
        else:
            command = server_command(model, port=port, extra=engine.sglang_command_args())
        say(f"starting {' '.join(command)}")
        # agentenv serve reads the key from its environment (kept out of the process list);
        # SGLang has it among its flags already (--sglang-api-key).
        env = {"AGENTENV_API_KEY": api_key} if api_key and engine.rollout_engine == "serve" else {}
        async with (
            Launcher(command, url, env=env),
            SGLangClient(url, api_key=api_key) as client,
            server_sync(config, client, weights_dir) as sync,
        ):
            yield ServerEngine(client, sync, capacity=await server_capacity(config, client))


@contextlib.asynccontextmanager
async def _engine_actors(
    config: TrainConfig,
    placed: Placed,
    weights_dir: Path,
    dtypes: tuple[torch.dtype, torch.dtype] | None,
) -> AsyncIterator[EngineGroup]:
    """One engine actor per engine of ``placed`` (in its first bundle, with the GPUs of all
    its bundles), behind SGLang's router; the weights from disk (``weights_dir``, on a
    path every node reaches) or broadcast from this process (``--weight-sync``)."""
    import dataclasses

    from trainer.distributed import EngineGroup, EngineSlot

    placement = placed.placement
    spec = dataclasses.replace(engine_spec(config, dtypes), cpus_per_engine=placement.share)
    slots = [
        EngineSlot(
            placed.group,
            bundles[0].index,
            num_gpus=placement.share if placement.gpus else 0.0,
            gpu_ids=tuple(str(g) for b in bundles for g in b.gpu_ids) or None,
        )
        for bundles in placed.engines
    ]
    engine = config.engine
    say(f"starting {len(slots)} engine actor(s) ({spec.kind}) behind sglang-router")
    router_host = "127.0.0.1"
    if config.placement.rollout_num_workers:  # rollout workers on other nodes reach it
        from trainer.distributed import node_address

        router_host = node_address()
    # What each engine decodes together: a launched agentenv serve's --rollout-max-running,
    # an SGLang server's --sglang-server-concurrency (slime's).
    per_engine = (
        engine.rollout_max_running
        if engine.rollout_engine == "serve"
        else engine.sglang_server_concurrency
    )
    group = EngineGroup(
        spec, len(slots), slots=slots, router_args=engine.router_args, api_key=engine.api_key(),
        router_host=router_host, capacity_per_engine=per_engine,
    )  # fmt: skip
    async with group:
        if engine.weight_sync == "disk":
            group.weight_sync("disk", directory=weights_dir)
        elif engine.weight_sync == "tensor":
            group.weight_sync("tensor")
        else:
            group.weight_sync(
                "distributed",
                backend=config.weight_sync_backend(),
                master_address=engine.weight_sync_master_address,
                bucket_bytes=engine.update_weight_buffer_size,
            )
        yield group


def rollout_workers(
    config: TrainConfig, policy: RolloutEngine, concurrency: int
) -> RolloutWorkers | None:
    """The run's rollout workers (:class:`~trainer.distributed.RolloutWorkers`,
    ``--rollout-num-workers``), generating through ``policy``'s router or server; None
    without them."""
    p = config.placement
    if not p.rollout_num_workers:
        return None
    from agentenv import ConfigError
    from trainer.distributed import RolloutWorkers, WorkerSpec

    url = policy.url
    if url is None:
        raise ConfigError(
            "rollout workers generate through a server they reach over the network; this "
            f"run's policy is a {type(policy).__name__}"
        )
    resources = {p.rollout_worker_resource: 1.0} if p.rollout_worker_resource else {}
    from agentenv.engine import resolve_model
    from trainer.run._setup import RAW_TEMPLATE, env_spec

    env = env_spec(config)
    spec = WorkerSpec(
        env.name, dict(env.args), str(resolve_model(config.model.hf_checkpoint)), url,
        chat_template=None if config.data.apply_chat_template else RAW_TEMPLATE,
        reward_args=dict(env.reward_args), api_key=config.engine.api_key(),
        concurrency=concurrency,
        num_cpus=p.rollout_num_cpus_per_worker, resources=resources,
        max_worker_rss_mb=p.rollout_worker_max_rss_mb,
    )  # fmt: skip
    say(
        f"starting {p.rollout_num_workers} rollout worker(s) on Ray "
        f"({p.rollout_num_cpus_per_worker:g} CPU each"
        f"{', 1 ' + p.rollout_worker_resource if p.rollout_worker_resource else ''})"
    )
    return RolloutWorkers(
        spec, p.rollout_num_workers, max_task_retries=p.rollout_worker_retries,
        start_timeout=p.placement_timeout, announce=config.checkpoint.save,
    )  # fmt: skip


def serve_args(
    config: TrainConfig, device: str, dtypes: tuple[torch.dtype, torch.dtype] | None = None
) -> list[str]:
    """A launched ``agentenv serve``'s flags: its device, batch and ``dtypes``."""
    extra = ["--device", device, "--max-running", str(config.engine.rollout_max_running)]
    if dtypes is not None:
        extra += ["--dtype", _dtype_name(dtypes[0]), "--residual-dtype", _dtype_name(dtypes[1])]
    return extra


async def server_capacity(config: TrainConfig, client: SGLangClient) -> int:
    """What the servers behind ``client`` decode together: an ``agentenv serve`` was
    launched with ``--rollout-max-running``; an SGLang server takes
    ``--sglang-server-concurrency`` (slime's), times a router's workers."""
    engine = config.engine
    if engine.rollout_url is not None:
        from agentenv.sglang import SGLangError

        try:
            servers = len(await client.list_workers())
        except SGLangError:  # a server, not a router
            servers = 1
        return engine.sglang_server_concurrency * max(servers, 1)
    if engine.rollout_engine == "serve":
        return engine.rollout_max_running
    return engine.sglang_server_concurrency


def engine_dtypes(backend: Backend, device: str) -> tuple[torch.dtype, torch.dtype]:
    """The rollout engine's ``(dtype, residual_dtype)`` for ``backend``: the torch backend's
    precision (fp32 weights under bf16 autocast: bf16 matrices, fp32 embeddings, norms and
    residual stream); megatron's bf16 on CUDA, fp32 on CPU."""
    import torch

    if backend.precision is not None:  # the torch backend's, or its ranks'
        return backend.precision.engine_dtypes()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return dtype, dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.asynccontextmanager
async def server_sync(
    config: TrainConfig, client: SGLangClient, weights_dir: Path
) -> AsyncIterator[WeightSync]:
    """How a server gets the trainer's weights (``--weight-sync``)."""
    from trainer.engines import DiskSync, DistributedSync, TensorSync

    engine = config.engine
    if engine.weight_sync == "disk":
        yield DiskSync([client], weights_dir)
        return
    if engine.weight_sync == "tensor":
        say(
            "weight sync: handed to the server by handle on the trainer's device "
            "(/update_weights_from_tensor)"
        )
        yield TensorSync([client], api_key=engine.api_key())
        return
    backend = config.weight_sync_backend()
    say(
        f"weight sync: {backend} broadcast to the server in buckets of "
        f"{engine.update_weight_buffer_size / 2**20:g} MiB"
    )
    async with DistributedSync(
        [client],
        backend=backend,
        master_address=engine.weight_sync_master_address,
        bucket_bytes=engine.update_weight_buffer_size,
    ) as sync:
        yield sync


def engine_spec(
    config: TrainConfig, dtypes: tuple[torch.dtype, torch.dtype] | None = None
) -> EngineSpec:
    """What each engine actor of the run starts: ``--rollout-engine serve`` (``agentenv
    serve`` on ``cuda`` when ``--device`` is a GPU -- the actor sees only its own -- with
    ``--rollout-max-running`` and ``dtypes``, the trainer's numerics) or ``sglang`` (the
    ``--sglang-*`` flags; ``--tp-size`` from ``--rollout-num-gpus-per-engine``), each
    on ``--rollout-num-gpus-per-engine`` GPUs. The API key (``--sglang-api-key`` or
    ``$AGENTENV_API_KEY``) reaches ``agentenv serve`` through its environment."""
    from agentenv import ConfigError
    from agentenv.engine import resolve_model
    from trainer.distributed import EngineSpec

    engine = config.engine
    if engine.rollout_engine == "embedded" or engine.rollout_url is not None:
        raise ConfigError(
            "engines as Ray actors need --rollout-engine serve or sglang (not "
            f"{engine.rollout_engine!r}{', with --rollout-url' if engine.rollout_url else ''})"
        )
    model = str(resolve_model(config.model.hf_checkpoint))
    gpus = engine.rollout_num_gpus_per_engine
    key = engine.api_key()
    if engine.rollout_engine == "serve":
        device = "cpu" if config.model.device == "cpu" else "cuda"
        return EngineSpec(
            model, kind="serve", gpus_per_engine=gpus,
            server_args=tuple(serve_args(config, device, dtypes)),
            env={"AGENTENV_API_KEY": key} if key else {},
        )  # fmt: skip
    return EngineSpec(
        model, kind="sglang", gpus_per_engine=gpus, server_args=tuple(engine.sglang_args)
    )
