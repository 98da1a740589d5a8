"""What the training loop does with a run's engine actors around each step
(:class:`~trainer.StepHooks`): colocated engines give their memory back while the trainer
runs on their GPUs, and the group's health joins every step's metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.engines import OffloadHooks

if TYPE_CHECKING:
    from trainer.distributed._engine_group import EngineGroup

__all__ = ["EngineHooks"]


class EngineHooks:
    """The loop's :class:`~trainer.StepHooks` for an :class:`EngineGroup`.

    With ``colocated`` (``--colocate``: the engines share the trainer's GPUs), every engine
    releases its memory (SGLang's ``/release_memory_occupation``) before a step's training
    and resumes it after, before the weight sync (:class:`~trainer.OffloadHooks`). Each
    step's metrics get the group's statistics as ``rollout/engine_*`` (``routed``,
    ``deaths``, ``replacements``, ``retried_requests``, ``failed_requests``: counts since
    the run began) and, colocated, ``rollout/engine_memory_releases`` (releases so far)
    and ``time_engine_memory_s`` (this step's release and resume)."""

    def __init__(self, group: EngineGroup, *, colocated: bool = False) -> None:
        self.group = group
        self._offload = OffloadHooks(group) if colocated else None

    async def before_train(self, step: int) -> None:
        """Colocated: every engine gives its memory back."""
        if self._offload is not None:
            await self._offload.before_train(step)

    async def after_train(self, step: int) -> None:
        """Colocated: every engine takes its memory back (the sync that follows writes
        into it)."""
        if self._offload is not None:
            await self._offload.after_train(step)

    def metrics(self) -> dict[str, float]:
        """The group's statistics (and, colocated, the memory releases) as metrics."""
        out = self.group.metrics()
        if self._offload is not None:
            out.update(self._offload.metrics())
        return out
