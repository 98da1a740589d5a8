"""A verifiers taskset with a toolset (verifiers' own v1 API): add two numbers with a tool.

verifiers serves the toolset over MCP from its own process, started as
``python -m agentenv_vf_add`` with its config in ``VF_CONFIG``."""

import os

import verifiers.v1 as vf


class AddToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is offered as plain `add`

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class AddData(vf.TaskData):
    answer: int


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return 1.0 if str(self.data.answer) in trace.last_reply else 0.0


class AddTaskset(vf.Taskset[AddTask, vf.TasksetConfig]):
    def load(self):
        return [
            AddTask(
                AddData(
                    prompt=f"What is {a}+{b}?", system_prompt="Use the add tool.", answer=a + b
                ),
                self.config.task,
            )
            for a, b in ((2, 3), (40, 2))
        ]

    @classmethod
    def toolsets(cls, config):
        return [AddToolset(vf.SharedToolsetConfig())]


__all__ = ["AddTaskset"]

if __name__ == "__main__" and "VF_CONFIG" in os.environ:
    AddToolset.__module__ = "agentenv_vf_add"
    AddToolset.run()
