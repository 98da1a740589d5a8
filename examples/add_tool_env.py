"""A tool-using environment in a dozen lines: the model calls ``add``, reads the result
and answers (tested offline in ``test_add_tool_env.py``)."""

from __future__ import annotations

from agentenv import Rubric, State, Task, ToolEnv, tool


@tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


def correct(task: Task, state: State) -> float:
    return 1.0 if state.completion.strip() == f"The answer is {task.answer}." else 0.0


class AddEnv(ToolEnv):
    name = "add"
    system_prompt = "Use the add tool, then reply 'The answer is N.'"
    tools = (add,)
    max_turns = 3  # ToolEnv's default is 10 model turns
    rubric = Rubric(correct)

    def tasks(self, split: str = "train") -> list[Task]:
        pairs = [(2, 3), (10, 32)]
        return [Task(id=f"{a}+{b}", prompt=f"What is {a} + {b}?", answer=a + b) for a, b in pairs]
