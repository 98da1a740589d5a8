"""What the training loop does with a run's engine actors around each step
(:class:`~trainer.StepHooks`): colocated engines give their memory back while the trainer
runs on their GPUs, and the group's health joins every step's metrics."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.distributed._engine_group import EngineGroup

__all__ = ["EngineHooks"]


class EngineHooks:
    """The loop's :class:`~trainer.StepHooks` for an :class:`EngineGroup`.

    With ``colocated`` (``--colocate``: the engines share the trainer's GPUs), every engine
    releases its memory (SGLang's ``/release_memory_occupation``) before a step's training
    and resumes it after, before the weight sync. Each step's metrics get the group's
    statistics as ``rollout/engine_*`` (``routed``, ``deaths``, ``replacements``,
    ``retried_requests``, ``failed_requests``: counts since the run began) and, colocated,
    ``rollout/engine_memory_releases`` (releases so far) and ``time_engine_memory_s``
    (this step's release and resume)."""

    def __init__(self, group: EngineGroup, *, colocated: bool = False) -> None:
        self.group = group
        self.colocated = colocated
        self.releases = 0  #: releases so far (each followed by a resume)
        self._memory_s = 0.0

    async def before_train(self, step: int) -> None:
        """Colocated: every engine gives its memory back."""
        self._memory_s = 0.0
        if self.colocated:
            start = time.perf_counter()
            await self.group.release_memory()
            self.releases += 1
            self._memory_s += time.perf_counter() - start

    async def after_train(self, step: int) -> None:
        """Colocated: every engine takes its memory back (the sync that follows writes
        into it)."""
        if self.colocated:
            start = time.perf_counter()
            await self.group.resume_memory()
            self._memory_s += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """The group's statistics (and, colocated, the memory releases) as metrics."""
        out = self.group.metrics()
        if self.colocated:
            out["rollout/engine_memory_releases"] = float(self.releases)
            out["time_engine_memory_s"] = self._memory_s
        return out
