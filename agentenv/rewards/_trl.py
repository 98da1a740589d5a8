"""Reward functions written for TRL's ``GRPOTrainer`` (its ``reward_funcs``: batched, called
by keyword), as reward functions ``(task, state) -> float``: :func:`from_trl` makes one
episode a batch of one (``prompts``, ``completions``, ``completion_ids`` and the task's
columns; the mapping: docs/rewards.md, "TRL's reward functions")."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agentenv._errors import ConfigError, RewardError
from agentenv._rewards import _is_async, _name, check_reward

if TYPE_CHECKING:
    from agentenv._environment import Task
    from agentenv._rewards import RewardFn, State

__all__ = ["from_trl"]


def from_trl(fn: Callable[..., Any], *, label_key: str | None = "answer") -> RewardFn:
    """``fn``, a TRL reward function (``def accuracy_reward(completions, solution,
    **kwargs) -> list[float]``), as a reward function ``(task, state) -> float`` (see the
    module docstring). ``label_key``: the column name ``task.answer`` is passed under
    (``None``: not passed).

    Raises:
        ConfigError: ``fn`` is not callable, or takes a parameter only by position (TRL
            passes every argument by keyword).
    """
    if not callable(fn):
        raise ConfigError(f"from_trl takes a function, got {type(fn).__name__}")
    name = _name(fn)
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = {}
    by_position = [p.name for p in params.values() if p.kind is p.POSITIONAL_ONLY]
    if by_position:
        raise ConfigError(
            f"TRL reward {name!r} takes {by_position} only by position; TRL passes every "
            "argument by keyword: drop the '/' from its signature"
        )
    any_keyword = not params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    required = [
        p.name
        for p in params.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]

    def arguments(task: Task, state: State) -> dict[str, Any]:
        columns: dict[str, list[Any]] = {k: [v] for k, v in task.info.items()}
        if label_key is not None:
            columns[label_key] = [task.answer]
        prompt, completion = _prompt_and_completion(task, state)
        given: dict[str, list[Any]] = {
            **columns,
            "prompts": [prompt],
            "completions": [completion],
            "completion_ids": [_completion_ids(state)],
        }
        missing = [n for n in required if n not in given]
        if missing:
            label = f"; task.answer is passed as {label_key!r}" if label_key else ""
            raise RewardError(
                f"TRL reward {name!r} needs the column(s) {missing}, but task {task.id!r} "
                f"has {sorted(columns)}{label} (--label-key names the label's column; "
                "from_trl(fn, label_key=...) in Python)"
            )
        return given if any_keyword else {k: v for k, v in given.items() if k in params}

    def read(values: Any) -> float:
        if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__len__"):
            raise RewardError(
                f"TRL reward {name!r} returned {type(values).__name__} {values!r}; it must "
                "return a list with one number per completion"
            )
        if len(values) != 1:
            raise RewardError(f"TRL reward {name!r} returned {len(values)} values for 1 completion")
        value = values[0]
        # TRL's None: the function does not score this completion; it adds nothing.
        return 0.0 if value is None else check_reward(value, name)

    if _is_async(fn):

        async def scored_async(task: Task, state: State) -> float:
            return read(await fn(**arguments(task, state)))

        scored_async.__name__ = name
        return scored_async

    def scored(task: Task, state: State) -> float:
        return read(fn(**arguments(task, state)))

    scored.__name__ = name
    return scored


def _prompt_and_completion(task: Task, state: State) -> tuple[Any, Any]:
    if isinstance(task.prompt, str):
        return task.prompt, state.completion
    messages = [dict(m) for m in state.messages]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return messages[:first], messages[first:]


def _completion_ids(state: State) -> list[int]:
    transcript = getattr(state, "transcript", None)
    return list(transcript.current.completion_ids) if transcript is not None else []
