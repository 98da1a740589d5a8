"""Engines that share the trainer's memory give it back while each step trains
(:class:`~trainer.StepHooks`), SGLang's ``/release_memory_occupation`` and
``/resume_memory_occupation`` around the optimizer steps.

On the ``sync`` schedule no episode runs while the trainer trains, so the engine's memory
is idle then: its key/value cache (the prefix cache with it: the weight sync after the
step would drop it anyway) and, on CPU, its weights (the sync loads them again). The
embedded engine on CPU does this by default (``--offload-rollout``); engines on Ray with
``--colocate`` always do (:class:`~trainer.distributed.EngineHooks`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.engines._engines import RolloutEngine

__all__ = ["OffloadHooks"]


class OffloadHooks:
    """Before a step's training ``engine`` (a :class:`~trainer.RolloutEngine`) releases
    its memory; after it, before the weight sync, it takes the
    memory back. Each step's metrics get ``rollout/engine_memory_releases`` (releases so
    far) and ``time_engine_memory_s`` (this step's release and resume)."""

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
