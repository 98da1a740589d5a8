"""``calculator``: multi-step arithmetic solved with ``add`` and ``multiply`` tools.

The model sees the tools through the chat template, calls them in Hermes
``<tool_call>`` format, reads the results and answers. Reward: 1 for the right final
integer, minus 0.1 per failed tool call.
"""

from __future__ import annotations

import random

from agentenv import Rubric, State, Task, ToolEnv, tool
from environments._answers import correct


@tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


@tool
async def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def tool_discipline(task: Task, state: State) -> float:
    """-0.1 per failed tool call, so that correct answers dominate."""
    return -0.1 * float(state.info.get("tool_errors", 0) or 0)


class CalculatorEnv(ToolEnv):
    """``(a + b) * c`` questions, tools for each step."""

    name = "calculator"
    system_prompt = (
        "Solve the problem step by step using the tools. When you know the result, "
        "reply with the final number alone."
    )
    tools = (add, multiply)
    max_turns = 6
    rubric = Rubric(correct, tool_discipline)

    def __init__(self, n_train: int = 1000, n_test: int = 200) -> None:
        self.sizes = {"train": n_train, "test": n_test}

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self.sizes:
            raise ValueError(f"split must be one of {sorted(self.sizes)}, got {split!r}")
        rng = random.Random(10 + sorted(self.sizes).index(split))
        out = []
        for i in range(self.sizes[split]):
            a, b, c = rng.randint(1, 99), rng.randint(1, 99), rng.randint(2, 9)
            out.append(
                Task(
                    id=f"{split}-{i}",
                    prompt=f"Compute ({a} + {b}) * {c}.",
                    answer=(a + b) * c,
                    info={"a": a, "b": b, "c": c},
                )
            )
        return out
