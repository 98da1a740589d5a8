"""What the training loop does with a run's engine actors around each step
(:class:`~trainer.StepHooks`): colocated engines give their memory back while the trainer
runs on their GPUs, and the group's health joins every step's metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.engines import OffloadHooks

if TYPE_CHECKING:
    from trainer.distributed._engine_group import EngineGroup

__all__ = ["EngineHooks"]


class EngineHooks(OffloadHooks):
    """The loop's :class:`~trainer.StepHooks` for an :class:`EngineGroup`: with
    ``colocated`` (``--colocate``: the engines share the trainer's GPUs) every engine
    releases its memory before a step's training and resumes it after, before the weight
    sync (:class:`~trainer.OffloadHooks`, whose metrics join the step's); and each step's
    metrics get the group's statistics as ``rollout/engine_*`` (``routed``, ``deaths``,
    ``replacements``, ``retried_requests``, ``failed_requests``: counts since the run
    began)."""

    def __init__(self, group: EngineGroup, *, colocated: bool = False) -> None:
        super().__init__(group)
        self.group = group
        self.colocated = colocated

    async def before_train(self, step: int) -> None:
        if self.colocated:
            await super().before_train(step)

    async def after_train(self, step: int) -> None:
        if self.colocated:
            await super().after_train(step)

    def metrics(self) -> dict[str, float]:
        return {**self.group.metrics(), **(super().metrics() if self.colocated else {})}
