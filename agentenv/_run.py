""":func:`run`: play an environment on a model in one synchronous call (tests, notebooks).

    result = agentenv.run(ReverseEnv(), ScriptedModel(tok, rules), n=2)
    assert [s.reward for s in result.samples] == [1.0, 0.0]

:func:`~agentenv.run_rollouts` with the ceremony taken care of: the tasks default to the
environment's split, the tokenizer to the model's own, the samples come back in task
order, and the event loop is started and closed (docs/guide.md, "Testing an environment")."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from agentenv._environment import Environment, Task
from agentenv._errors import ConfigError, at_least
from agentenv._generator import Generator
from agentenv._runner import RolloutConfig, RolloutStats, SampleSink, run_rollouts
from agentenv._sample import Sample
from agentenv._tokenizer import Tokenizer

__all__ = ["RolloutResult", "run"]


@dataclasses.dataclass(frozen=True, slots=True)
class RolloutResult:
    """What :func:`run` produced.

    Attributes:
        samples: every sample in task order: the tasks in the order they were given,
            each task's samples in episode order (within an episode, in the order the
            environment returned them) -- not in the order the groups finished.
        stats: counts, rewards and failures (:class:`~agentenv.RolloutStats`).
    """

    samples: list[Sample]
    stats: RolloutStats

    def by_task(self) -> dict[str, list[Sample]]:
        """The samples of each task id, in task order and episode order."""
        out: dict[str, list[Sample]] = {}
        for s in self.samples:
            out.setdefault(s.task_id or "", []).append(s)
        return out

    def summary(self) -> dict[str, Any]:
        """The stats as a JSON-ready dict (as ``agentenv eval --json`` prints them)."""
        return self.stats.to_dict()


class _Tee:
    """Keeps every group and passes it on to ``sink`` (as it finishes)."""

    def __init__(self, sink: SampleSink | None) -> None:
        self.groups: list[list[Sample]] = []
        self.sink = sink

    async def put_group(self, samples: Sequence[Sample]) -> None:
        self.groups.append(list(samples))
        if self.sink is not None:
            await self.sink.put_group(samples)

    def in_task_order(self, tasks: Sequence[Task]) -> list[Sample]:
        """The kept samples, group by group in the order of ``tasks``; a group arrives
        whole and already in episode order, so only the groups are reordered (stable: a
        group whose task id an environment rewrote keeps its place at the end)."""
        position = {t.id: i for i, t in enumerate(tasks)}
        late = len(tasks)

        def key(group: list[Sample]) -> int:
            return position.get(group[0].task_id or "", late) if group else late

        return [s for group in sorted(self.groups, key=key) for s in group]


def _running_loop() -> str | None:
    """The async library whose event loop runs in this thread, if any."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return None
        return "trio"
    return None


def run(
    env: Environment,
    model: Generator,
    *,
    tasks: Sequence[Task] | None = None,
    split: str = "train",
    n: int | None = None,
    tokenizer: Tokenizer | None = None,
    policies: Mapping[str, Generator] | None = None,
    sink: SampleSink | None = None,
    config: RolloutConfig | None = None,
    **settings: Any,
) -> RolloutResult:
    """Play ``env`` on ``model`` and return the samples and stats; blocks until done.

    Args:
        env: the environment.
        model: the generator for every role not in ``policies`` (a :class:`ScriptedModel`,
            the embedded engine, a server client).
        tasks: the tasks to play (default: ``env.tasks(split)``).
        split: the split the default tasks come from.
        n: play only the first ``n`` tasks.
        tokenizer: renders transcripts (default: the model's own tokenizer).
        policies: per-role generators (fixed opponents).
        sink: also put every finished group there (a Buffer, a :class:`JsonlSink`).
        config: a :class:`RolloutConfig`; or give its fields as keyword arguments
            (``n_samples_per_prompt=4``, ``seed=1``, ``limits=Limits(...)``).

    Raises:
        RuntimeError: when called inside a running event loop (await
            :func:`run_rollouts` there).
    """
    library = _running_loop()
    if library is not None:
        raise RuntimeError(
            f"agentenv.run() blocks, so it cannot run inside the running {library} event "
            "loop (an async test, a notebook cell); there, await the async API: "
            "stats = await run_rollouts(env, tasks, model, sink=ListSink())"
        )
    if config is not None and settings:
        raise ConfigError(
            f"pass either config= or RolloutConfig fields, not both (got config and "
            f"{sorted(settings)})"
        )
    if config is None:
        fields = {f.name for f in dataclasses.fields(RolloutConfig)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            raise ConfigError(
                f"unknown run setting(s) {unknown}; RolloutConfig fields: {sorted(fields)}"
            )
        config = RolloutConfig(**settings)
    if n is not None:
        at_least("n", n, 1)
    chosen = list(env.tasks(split) if tasks is None else tasks)[:n]
    tee = _Tee(sink)

    async def go() -> RolloutStats:
        return await run_rollouts(
            env, chosen, model, tokenizer=tokenizer, sink=tee, config=config, policies=policies
        )

    stats = anyio.run(go)
    return RolloutResult(samples=tee.in_task_order(chosen), stats=stats)
