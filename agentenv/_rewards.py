"""Reward functions and their weighted combination (:class:`Rubric`).

A reward function takes ``(task, state)`` and returns a number (``bool``: 0 or 1),
directly or as an awaitable; a group reward function takes ``(task, samples)`` and returns
one number per sample. A value that is not a finite number, and whatever a function
raises but a cancellation or ``KeyboardInterrupt``, is a :class:`RewardError`: its sample
fails, never the run. A synchronous function runs in a daemon worker thread (at most
``max_threads`` at once), abandoned when the episode's timeout fires (docs/rewards.md)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from agentenv._errors import ConfigError, RewardError
from agentenv._sample import JSONValue, Sample

if TYPE_CHECKING:
    from agentenv._environment import Episode, Task
    from agentenv._messages import Message
    from agentenv._transcript import Transcript

__all__ = ["NO_RUBRIC", "GroupRewardFn", "RewardFn", "Rubric", "State", "check_rubric", "reward"]

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


# Worker threads for synchronous reward functions, per rubric at once (``max_threads``).
REWARD_THREADS = 32


def check_reward(value: Any, source: str) -> float:
    """``value`` as a finite float (``True``/``False``: 1.0/0.0), or :class:`RewardError`
    naming ``source``."""
    # numbers.Real admits numpy scalars (np.float32, np.int64), which verifiers often
    # return, and bool: ``return answer == label`` is the common idiom.
    if not isinstance(value, numbers.Real):
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
    """Rename a reward function (``name``). ``blocking=True`` marks synchronous code that
    blocks; every synchronous reward function runs in a worker thread anyway, so it only
    checks that the function is not async."""

    def wrap(fn: RewardFn) -> RewardFn:
        if blocking and _is_async(fn):
            raise ConfigError(f"reward {_name(fn)!r} is async; blocking=True is for sync code")
        if name:
            fn.__name__ = name
        return fn

    return wrap


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine (an ``async def``, or an object whose
    ``__call__`` is one): run on the event loop, not in a thread."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 -- the method, not callable()
    )


def trl_style(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is written for TRL's ``GRPOTrainer``: a parameter named
    ``completions`` and none named ``task`` (see :func:`agentenv.rewards.from_trl`)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "completions" in params and "task" not in params


async def _in_daemon_thread(fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
    """``fn(*args)`` in a new daemon thread; cancelling the caller abandons the thread.

    Not anyio's worker threads: those are not daemons, so one that never returns would
    keep the process from exiting after the run."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    outcome: list[tuple[bool, Any]] = []
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome.append((True, context.run(fn, *args)))
        except BaseException as e:  # re-raised in the caller
            outcome.append((False, e))
        # RuntimeError: the event loop is gone, nobody waits for this any more.
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=target, name=f"reward {name}", daemon=True).start()
    await done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


class Rubric:
    """A weighted sum of reward functions, plus optional group reward functions.

    ``Rubric(correct, (brevity, 0.1))`` gives ``1.0 * correct + 0.1 * brevity``.
    Each component's value is recorded in the sample's ``metadata["rewards"]``.
    """

    def __init__(
        self,
        *funcs: RewardFn | tuple[RewardFn, float],
        group: Sequence[GroupRewardFn | tuple[GroupRewardFn, float]] = (),
        max_threads: int = REWARD_THREADS,
    ) -> None:
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ConfigError(f"max_threads must be a positive int, got {max_threads!r}")
        self.max_threads = max_threads
        # Created in the event loop that first needs it (a limiter belongs to one loop).
        self._threads: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar(
            "reward_threads"
        )
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
        if signature is not None and trl_style(fn):
            raise ConfigError(
                f"reward function {_name(fn)!r}{signature} is written for TRL's GRPOTrainer "
                f"(batched, by keyword); wrap it: agentenv.rewards.from_trl({_name(fn)})"
            )
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
            v = check_reward(await self.call(fn, task, state), _name(fn))
            parts[_name(fn)] = v
            total += weight * v
        return total, parts

    async def score_group(self, task: Task, samples: Sequence[Sample]) -> list[float]:
        """Per-sample weighted sum of the group functions (0.0 each when there are none)."""
        totals = [0.0] * len(samples)
        for fn, weight in self.group:
            values = await self.call(fn, task, samples)
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

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """What the user's reward function ``fn`` returns for ``args``: awaited when async,
        else from a worker thread (abandoned when the caller is cancelled, e.g. by the
        episode's timeout). A ``BaseException`` that is not a cancellation or
        ``KeyboardInterrupt`` (``SystemExit``, ``GeneratorExit``) becomes a
        :class:`RewardError` naming the function: it fails the sample, not the run."""
        try:
            if _is_async(fn):
                value = fn(*args)
            else:
                async with self._limiter():
                    value = await _in_daemon_thread(fn, args, _name(fn))
            if inspect.isawaitable(value):
                value = await value
        except (Exception, KeyboardInterrupt, anyio.get_cancelled_exc_class()):
            raise
        except BaseException as e:
            raise RewardError(
                f"reward function {_name(fn)!r} raised {type(e).__name__}"
                f"{f' {e}' if str(e) else ''}; a reward function returns a number or raises "
                "an Exception (its sample fails)"
            ) from e
        return value

    def _limiter(self) -> anyio.CapacityLimiter:
        try:
            return self._threads.get()
        except LookupError:
            limiter = anyio.CapacityLimiter(self.max_threads)
            self._threads.set(limiter)
            return limiter


# The rubric of an environment that set none. Running one is refused (every sample would
# score 0); an environment that means to give no reward sets ``rubric = Rubric()`` itself.
NO_RUBRIC = Rubric()


def check_rubric(env: Any) -> None:
    """Refuse ``env`` (an environment scored by its ``rubric``) when it set none."""
    if env.rubric is NO_RUBRIC:
        raise ConfigError(
            f"{type(env).__name__} has no rubric, so every sample would score 0; set "
            "rubric = Rubric(my_reward) on the class (a function (task, state) -> float), "
            "or rubric = Rubric() to run without a reward on purpose"
        )
