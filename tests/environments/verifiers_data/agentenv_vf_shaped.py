"""A single-turn verifiers taskset whose reward an untrained model can earn: the share of
letters in its reply (verifiers' own v1 API), so a training step has a signal."""

import verifiers.v1 as vf


class ShapedTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def letters(self, trace) -> float:
        reply = trace.last_reply
        return sum(c.isalpha() for c in reply) / max(len(reply), 1)


class ShapedTaskset(vf.Taskset[ShapedTask, vf.TasksetConfig]):
    def load(self):
        return [
            ShapedTask(vf.TaskData(prompt=f"Write word {i}."), self.config.task) for i in range(4)
        ]


__all__ = ["ShapedTaskset"]
