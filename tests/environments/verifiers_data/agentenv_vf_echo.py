"""A single-turn verifiers taskset (verifiers' own v1 API): say the number back."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: int


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return 1.0 if str(self.data.answer) in trace.last_reply else 0.0


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        return [
            EchoTask(EchoData(prompt=f"Say the number {n}.", answer=n), self.config.task)
            for n in (3, 14, 15)
        ]


__all__ = ["EchoTaskset"]
