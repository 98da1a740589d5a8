"""One rollout engine as a Ray actor: it runs one server process (``agentenv serve`` or
SGLang, through :class:`~agentenv.sglang.Launcher`) on the GPUs Ray gave it, and says
where it answers and whether the process still runs.

The actor is an async actor: its event loop holds a task that keeps the launcher's
``async with`` open until :meth:`EngineActor.stop`, so the server is started and stopped
in one task (as the launcher's task group needs). When the actor dies (killed, or its node
lost), Ray ends its child processes with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Literal

import anyio

from agentenv import ConfigError
from trainer.distributed._cluster import node_address

__all__ = ["EngineActor", "EngineInfo", "EngineSpec"]


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What every engine of a group runs.

    Args:
        model: the HF model directory (on every node) or a model name ``agentenv serve``
            resolves.
        kind: ``serve`` (``python -m agentenv serve``) or ``sglang``
            (``python -m sglang.launch_server``).
        gpus_per_engine: ``--rollout-num-gpus-per-engine``: GPUs each engine takes (Ray
            logical GPUs on CPU). An SGLang engine of several GPUs gets ``--tp-size`` of it
            unless ``server_args`` set one.
        server_args: flags for the server, as it spells them: the ``--sglang-*`` flags with
            the prefix stripped (:func:`~agentenv.sglang.split_passthrough`), or
            ``agentenv serve``'s own (``--device``, ``--max-running``, ...).
        host: the interface the server binds and is reached at; default the node's IP
            address as Ray knows it (``127.0.0.1`` keeps a one-machine run on loopback).
        env: extra environment variables for the server (``AGENTENV_API_KEY``, ...).
        health_timeout: seconds a server may take to answer ``/health`` after its start.
        cpus_per_engine: Ray CPUs each engine actor holds.
    """

    model: str
    kind: Literal["serve", "sglang"] = "serve"
    gpus_per_engine: int = 1
    server_args: tuple[str, ...] = ()
    host: str | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    health_timeout: float = 1200.0
    cpus_per_engine: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("serve", "sglang"):
            raise ConfigError(f"kind must be serve or sglang, got {self.kind!r}")
        if self.gpus_per_engine < 0:
            raise ConfigError(
                f"gpus_per_engine (--rollout-num-gpus-per-engine) must be at least 0, got "
                f"{self.gpus_per_engine}"
            )
        if self.health_timeout <= 0 or self.cpus_per_engine < 0:
            raise ConfigError(
                f"health_timeout must be positive and cpus_per_engine non-negative, got "
                f"{self.health_timeout} and {self.cpus_per_engine}"
            )
        object.__setattr__(self, "server_args", tuple(self.server_args))
        object.__setattr__(self, "env", dict(self.env))

    def command(self, host: str, port: int) -> list[str]:
        """The server's command line, listening at ``host:port``."""
        from agentenv.sglang import server_command

        extra = list(self.server_args)
        if self.kind == "serve":
            program = [sys.executable, "-m", "agentenv", "serve"]
            return server_command(self.model, host=host, port=port, extra=extra, program=program)
        names = {a.split("=", 1)[0] for a in extra}
        if self.gpus_per_engine > 1 and not names & {"--tp-size", "--tp", "--tensor-parallel-size"}:
            extra += ["--tp-size", str(self.gpus_per_engine)]
        return server_command(self.model, host=host, port=port, extra=extra)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """Where one engine runs: its server's URL, Ray node, GPUs (as Ray assigned them, or
    the slot's) and server process id."""

    url: str
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    pid: int


class EngineActor:
    """The body of an engine actor (made remote by :class:`~trainer.distributed.EngineGroup`
    with the resources of its slot)."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._stop = anyio.Event()
        self._process: anyio.abc.Process | None = None
        self._launcher: object | None = None

    async def start(self, spec: EngineSpec, gpu_ids: tuple[str, ...] | None = None) -> EngineInfo:
        """Start the server; return once it is healthy. ``gpu_ids``: the devices it may
        use (``CUDA_VISIBLE_DEVICES``), default those Ray gave this actor."""
        import ray

        from agentenv.sglang import Launcher
        from trainer._resources import free_port

        if self._task is not None:
            raise ConfigError("this engine actor has started its server already")
        context = ray.get_runtime_context()
        node_ip = node_address()
        host = spec.host or node_ip
        port = free_port(host)
        url = f"http://{host}:{port}"
        env = dict(spec.env)
        if gpu_ids is None:
            gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        launcher = Launcher(
            spec.command(host, port), url, health_timeout=spec.health_timeout, env=env
        )
        ready = anyio.Event()
        failure: list[BaseException] = []

        async def run() -> None:
            try:
                async with launcher:
                    self._process = launcher.process
                    self._launcher = launcher
                    ready.set()
                    await self._stop.wait()
            except BaseException as e:  # reported by start(); the actor stays usable
                failure.append(e)
            finally:
                self._process = None
                ready.set()

        self._task = asyncio.get_running_loop().create_task(run())
        await ready.wait()
        if failure:
            raise failure[0]
        assert launcher.process is not None
        return EngineInfo(url, context.get_node_id(), node_ip, gpu_ids, launcher.process.pid)

    def alive(self) -> str | None:
        """``None`` while the server process runs, else why not (with its last output)."""
        process = self._process
        if process is None:
            return "the server is not running"
        if process.returncode is not None:
            tail = getattr(self._launcher, "output", "")[-2000:]
            return f"the server exited with code {process.returncode}; its last output:\n{tail}"
        return None

    def pid(self) -> int:
        """This actor's own process id."""
        return os.getpid()

    def peak_rss_gib(self) -> float:
        """The largest peak resident set so far (GiB) of this actor's process and its
        server's (the server and every process it started)."""
        from trainer._resources import peak_rss_gib

        process = self._process
        server = peak_rss_gib(process.pid, descendants=True) if process is not None else 0.0
        return max(peak_rss_gib(), server)

    async def stop(self) -> None:
        """Stop the server (SIGTERM to its process group, then SIGKILL)."""
        self._stop.set()
        if self._task is not None:
            await self._task
