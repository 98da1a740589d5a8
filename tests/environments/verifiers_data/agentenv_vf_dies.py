"""A verifiers taskset whose first task's rubric ends the process it runs in."""

import os

import verifiers.v1 as vf


class DyingData(vf.TaskData):
    dies: bool


class DyingTask(vf.Task[DyingData]):
    @vf.reward
    async def survive(self, trace) -> float:
        if self.data.dies:
            os._exit(3)
        return 1.0


class DyingTaskset(vf.Taskset[DyingTask, vf.TasksetConfig]):
    def load(self):
        return [
            DyingTask(DyingData(prompt="Say hi.", dies=dies), self.config.task)
            for dies in (True, False)
        ]


__all__ = ["DyingTaskset"]
