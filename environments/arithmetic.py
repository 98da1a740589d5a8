"""``arithmetic``: one question, one answer, reward 1 for the exact integer.

Tasks are generated from a seed (no data download): ``train`` and ``test`` use different
seeds, so they do not overlap by construction of the id. Run it with::

    agentenv eval --env arithmetic --model scripted:examples/scripts/arithmetic_oracle.py --n 50
"""

from __future__ import annotations

import random

from agentenv import Rubric, SingleTurnEnv, Task
from environments._answers import correct

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_SPLIT_SEEDS = {"train": 1, "test": 2}


def make_tasks(split: str, n: int, max_operand: int) -> list[Task]:
    """``n`` seeded questions ``a op b`` with operands in ``[0, max_operand]``."""
    rng = random.Random(_SPLIT_SEEDS[split])
    tasks = []
    for i in range(n):
        op = rng.choice(sorted(_OPS))
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        tasks.append(
            Task(id=f"{split}-{i}", prompt=f"What is {a} {op} {b}?", answer=_OPS[op](a, b))
        )
    return tasks


class ArithmeticEnv(SingleTurnEnv):
    """Integer arithmetic, answered in one turn."""

    name = "arithmetic"
    system_prompt = "Answer the question. End your reply with the number alone."
    rubric = Rubric(correct)

    def __init__(self, n_train: int = 1000, n_test: int = 200, max_operand: int = 100) -> None:
        if min(n_train, n_test, max_operand) < 1:
            raise ValueError("n_train, n_test and max_operand must be at least 1")
        self.sizes = {"train": n_train, "test": n_test}
        self.max_operand = max_operand

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self.sizes:
            raise ValueError(f"split must be one of {sorted(self.sizes)}, got {split!r}")
        return make_tasks(split, self.sizes[split], self.max_operand)
