"""A verifiers taskset whose rubric raises (verifiers' own v1 API)."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def broken(self, trace) -> float:
        raise ValueError("this rubric is broken on purpose")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        return [BrokenTask(vf.TaskData(prompt="Say hi."), self.config.task)]


__all__ = ["BrokenTaskset"]
