"""Answer extraction and the exact-answer reward shared by the arithmetic environments."""

from __future__ import annotations

import re

from agentenv import State, Task

_INT = re.compile(r"-?\d[\d,]*")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (``1,234`` counts as 1234), or ``None``."""
    found = _INT.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


def correct(task: Task, state: State) -> float:
    """1.0 if the last integer in the answer is the right one."""
    return 1.0 if last_integer(state.completion) == task.answer else 0.0
