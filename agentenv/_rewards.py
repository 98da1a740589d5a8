"""Reward functions and their weighted combination (:class:`Rubric`).

A reward function takes ``(task, state)`` and returns a number, directly or as an
awaitable. A group reward function takes ``(task, samples)`` for a whole GRPO group and
returns one number per sample (e.g. a bonus for the shortest correct answer). Every value
is checked: NaN, infinities and non-numbers raise :class:`RewardError` naming the function.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from agentenv._errors import ConfigError, RewardError
from agentenv._sample import JSONValue, Sample

if TYPE_CHECKING:
    from agentenv._environment import Episode, Task
    from agentenv._messages import Message
    from agentenv._transcript import Transcript

__all__ = ["GroupRewardFn", "RewardFn", "Rubric", "State", "reward"]

RewardFn = Callable[["Task", "State"], float | Awaitable[float]]
GroupRewardFn = Callable[["Task", Sequence[Sample]], Sequence[float] | Awaitable[Sequence[float]]]


@dataclasses.dataclass(slots=True)
class State:
    """An episode in progress, as reward functions and ``respond`` see it.

    ``info`` is scratch space for the environment; what is JSON there ends up in the
    sample's metadata.
    """

    task: Task
    transcript: Transcript
    episode: Episode
    info: dict[str, JSONValue] = dataclasses.field(default_factory=dict)

    @property
    def completion(self) -> str:
        """The last assistant message's text."""
        return self.transcript.last_assistant

    @property
    def messages(self) -> list[Message]:
        return self.transcript.messages

    @property
    def turns(self) -> int:
        return self.transcript.turns


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def check_reward(value: Any, source: str) -> float:
    """``value`` as a finite float, or :class:`RewardError` naming ``source``."""
    # numbers.Real admits numpy scalars (np.float32, np.int64), which verifiers often return.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {source!r} returned {type(value).__name__} {value!r}; "
            "it must return a finite number"
        )
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float is not finite either
        raise RewardError(
            f"reward function {source!r} returned an int beyond float range; it must be finite"
        ) from None
    if not math.isfinite(number):
        raise RewardError(f"reward function {source!r} returned {number}; it must be finite")
    return number


def reward(*, blocking: bool = False, name: str | None = None) -> Callable[[RewardFn], RewardFn]:
    """Mark a synchronous reward function as blocking (run in a worker thread) or rename it."""

    def wrap(fn: RewardFn) -> RewardFn:
        if blocking:
            if inspect.iscoroutinefunction(fn):
                raise ConfigError(f"reward {_name(fn)!r} is async; blocking=True is for sync code")

            async def threaded(task: Task, state: State) -> float:
                return await anyio.to_thread.run_sync(fn, task, state)  # type: ignore[arg-type]

            threaded.__name__ = name or _name(fn)
            return threaded
        if name:
            fn.__name__ = name
        return fn

    return wrap


class Rubric:
    """A weighted sum of reward functions, plus optional group reward functions.

    ``Rubric(correct, (brevity, 0.1))`` gives ``1.0 * correct + 0.1 * brevity``.
    Each component's value is recorded in the sample's ``metadata["rewards"]``.
    """

    def __init__(
        self,
        *funcs: RewardFn | tuple[RewardFn, float],
        group: Sequence[GroupRewardFn | tuple[GroupRewardFn, float]] = (),
    ) -> None:
        self.funcs: list[tuple[RewardFn, float]] = [
            self._weighted(f, "(task, state)") for f in funcs
        ]
        if callable(group):
            raise ConfigError(
                f"group must be a list of group reward functions, got {_name(group)!r} alone; "
                "wrap it in a list"
            )
        self.group: list[tuple[GroupRewardFn, float]] = [
            self._weighted(f, "(task, samples)") for f in group
        ]
        # Components are reported by name (score's dict, metadata["rewards"]); two functions
        # of one name (two lambdas, one function listed twice) would silently lose one.
        names = [_name(fn) for fn, _ in self.funcs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"reward function names must be unique, got {dupes} more than once; "
                "rename with reward(name=...)"
            )

    @staticmethod
    def _weighted(item: Any, arguments: str) -> tuple[Any, float]:
        if isinstance(item, tuple) and len(item) != 2:
            raise ConfigError(f"a weighted reward is a (function, weight) pair, got {item!r}")
        fn, weight = item if isinstance(item, tuple) else (item, 1.0)
        if not callable(fn):
            hint = (
                "; a weight goes with its function in a pair: Rubric((my_reward, 0.5))"
                if isinstance(fn, int | float)
                else ""
            )
            raise ConfigError(f"a reward must be callable, got {type(fn).__name__}{hint}")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none: called as they are
            signature = None
        if signature is not None:
            try:
                signature.bind(None, None)
            except TypeError:
                raise ConfigError(
                    f"reward function {_name(fn)!r}{signature} cannot be called as "
                    f"{_name(fn)}{arguments}; write it as def {_name(fn)}{arguments} -> float"
                ) from None
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
        ):
            raise ConfigError(
                f"reward weight for {_name(fn)!r} must be a finite number, got {weight!r}"
            )
        return fn, float(weight)

    async def score(self, task: Task, state: State) -> tuple[float, dict[str, float]]:
        """The weighted total and each component's raw value."""
        total = 0.0
        parts: dict[str, float] = {}
        for fn, weight in self.funcs:
            value = fn(task, state)
            if inspect.isawaitable(value):
                value = await value
            v = check_reward(value, _name(fn))
            parts[_name(fn)] = v
            total += weight * v
        return total, parts

    async def score_group(self, task: Task, samples: Sequence[Sample]) -> list[float]:
        """Per-sample weighted sum of the group functions (0.0 each when there are none)."""
        totals = [0.0] * len(samples)
        for fn, weight in self.group:
            values = fn(task, samples)
            if inspect.isawaitable(values):
                values = await values
            try:
                values = list(values)
            except TypeError:  # e.g. one float for the whole group
                raise RewardError(
                    f"group reward {_name(fn)!r} returned {type(values).__name__} {values!r}; "
                    "it must return one number per sample"
                ) from None
            if len(values) != len(samples):
                raise RewardError(
                    f"group reward {_name(fn)!r} returned {len(values)} values "
                    f"for {len(samples)} samples"
                )
            for i, v in enumerate(values):
                totals[i] += weight * check_reward(v, _name(fn))
        return totals
