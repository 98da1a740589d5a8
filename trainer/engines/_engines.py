"""The loop's one seam to the engines that play the episodes: :class:`RolloutEngine`.

Three kinds implement it: :class:`EmbeddedEngine` (an :class:`~agentenv.engine.Engine` in
this process), :class:`ServerEngine` (``agentenv serve`` or SGLang servers, launched for
the run or already running, behind an :class:`~agentenv.sglang.SGLangClient`) and
:class:`~trainer.distributed.EngineGroup` (engine actors on Ray behind SGLang's router).
The loop generates through it, sizes its rounds by its capacity, pushes the trainer's
weights into it at each version and, between rollouts, has it give its memory back while
the trainer trains (:class:`OffloadHooks`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from agentenv import Completion, SamplingParams
    from agentenv.engine import Engine
    from agentenv.sglang import SGLangClient
    from trainer.backends import Backend
    from trainer.engines._sync import WeightSync

__all__ = ["EmbeddedEngine", "OffloadHooks", "RolloutEngine", "ServerEngine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the training loop needs of the engines (a :class:`~agentenv.Generator` and
    more): generation, what they decode together, the trainer's weights at a version,
    their memory given back and taken again, their metrics, and closing."""

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        """One generation (the :class:`~agentenv.Generator` protocol)."""

    @property
    def capacity(self) -> int | None:
        """Requests the engines decode together (``None``: they do not say)."""

    @property
    def url(self) -> str | None:
        """Where a process elsewhere (a rollout worker) generates through them (``None``:
        only in this process)."""

    @property
    def device(self) -> str | None:
        """The device of an engine in this process (``None``: the engines run elsewhere)."""

    async def sync_weights(self, backend: Backend, version: int) -> None:
        """The engines generate with ``backend``'s weights from now on, stamped ``version``."""

    async def release_memory(self) -> None:
        """The engines give their memory back (no episode runs until :meth:`resume_memory`)."""

    async def resume_memory(self) -> None:
        """The engines take their memory back (the weight sync that follows writes into it)."""

    def metrics(self) -> dict[str, float]:
        """Metrics added to each step's (e.g. engine deaths and replacements)."""

    async def aclose(self) -> None:
        """Stop the engines (or the connection to them)."""


class EmbeddedEngine:
    """An :class:`~agentenv.engine.Engine` in this process as a :class:`RolloutEngine`:
    the weights copied in between two decode steps (``update_weights``), its capacity its
    ``max_running``. :meth:`aclose` closes the engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        return await self.engine.generate(input_ids, params, rid=rid)

    @property
    def capacity(self) -> int:
        return self.engine.max_running

    @property
    def url(self) -> None:
        return None

    @property
    def device(self) -> str:
        return str(self.engine.device)

    async def sync_weights(self, backend: Backend, version: int) -> None:
        await self.engine.update_weights(backend.state_dict(), weight_version=str(version))

    async def release_memory(self) -> None:
        await self.engine.release_memory()

    async def resume_memory(self) -> None:
        await self.engine.resume_memory()

    def metrics(self) -> dict[str, float]:
        return {}

    async def aclose(self) -> None:
        await self.engine.aclose()


class ServerEngine:
    """Servers (``agentenv serve``, SGLang, or a router in front of them) reached through
    ``client``, as a :class:`RolloutEngine`: the weights reach them through ``sync``
    (:class:`~trainer.DiskSync`, :class:`~trainer.TensorSync`,
    :class:`~trainer.DistributedSync`); ``capacity``: what they decode together, as they
    were launched. :meth:`aclose` closes the client (the servers are their launcher's)."""

    def __init__(
        self, client: SGLangClient, sync: WeightSync, *, capacity: int | None = None
    ) -> None:
        self.client = client
        self.sync = sync
        self._capacity = capacity

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        return await self.client.generate(input_ids, params, rid=rid)

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def device(self) -> None:
        return None

    async def sync_weights(self, backend: Backend, version: int) -> None:
        await self.sync(backend, version)

    async def release_memory(self) -> None:
        await self.client.release_memory_occupation()

    async def resume_memory(self) -> None:
        await self.client.resume_memory_occupation()

    def metrics(self) -> dict[str, float]:
        return {}

    async def aclose(self) -> None:
        await self.client.aclose()


class OffloadHooks:
    """The loop's :class:`~trainer.StepHooks` for an engine that shares the trainer's
    memory: before a step's training ``engine`` releases it (SGLang's
    ``/release_memory_occupation``: on the ``sync`` schedule no episode runs meanwhile);
    after it, before the weight sync, it takes the memory back. The embedded engine on CPU
    does this by default (``--offload-rollout``); engines on Ray with ``--colocate`` always
    do. Each step's metrics get ``rollout/engine_memory_releases`` (releases so far) and
    ``time_engine_memory_s`` (this step's release and resume)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.releases = 0  #: releases so far (each followed by a resume)
        self._memory_s = 0.0

    async def before_train(self, step: int) -> None:
        """The engine gives its memory back."""
        start = time.perf_counter()
        await self.engine.release_memory()
        self.releases += 1
        self._memory_s = time.perf_counter() - start

    async def after_train(self, step: int) -> None:
        """The engine takes its memory back (the sync that follows writes into it)."""
        start = time.perf_counter()
        await self.engine.resume_memory()
        self._memory_s += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """The releases so far and this step's time in them."""
        return {
            "rollout/engine_memory_releases": float(self.releases),
            "time_engine_memory_s": self._memory_s,
        }
