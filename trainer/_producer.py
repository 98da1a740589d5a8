"""The data side of the training loop: tasks in a seeded order, rollouts into the Buffer.

:class:`TaskStream` hands out tasks (optionally shuffled each pass over the data) and can
save and restore its position, so a resumed run plays the tasks the original would have.
:class:`Producer` plays rounds of tasks into the Buffer: ``fill`` until a batch of kept
groups is ready (over-sampling and dynamic-sampling filters drop groups, so it may take
several rounds), or ``run_forever`` for the asynchronous schedule, where the Buffer's
admission control keeps every group within the staleness bound.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from agentenv import (
    AgentEnvError,
    Completion,
    ConfigError,
    Environment,
    Limits,
    RolloutConfig,
    RolloutStats,
    Sample,
    SamplingParams,
    Task,
    TextGenerator,
    Tokenizer,
    run_rollouts,
)
from agentenv.buffer import Buffer

__all__ = ["FailedRoundsError", "Producer", "RoundStats", "TaskStream", "policy_capacity"]


class FailedRoundsError(AgentEnvError):
    """``max_failed_rounds`` rounds in a row failed every sample: the run stops, naming
    the commonest reasons, rather than replaying them."""


def policy_capacity(policy: Any) -> int | None:
    """How many requests ``policy`` decodes together, when it says: the embedded
    :class:`~agentenv.engine.Engine`'s ``max_running`` (``None`` for a generator that does
    not know, e.g. a client of servers whose capacity is set where they are launched)."""
    capacity = getattr(policy, "max_running", None)
    return capacity if isinstance(capacity, int) and capacity > 0 else None


class TaskStream:
    """Takes ``n`` distinct tasks at a time, in order or reshuffled (seeded) at each pass."""

    def __init__(self, tasks: Sequence[Task], *, seed: int, shuffle: bool) -> None:
        self.tasks = {t.id: t for t in tasks}
        self.shuffle = shuffle
        self._rng = random.Random(seed)
        self._order: list[str] = []  # what is left of the current pass, next task last

    def take(self, n: int) -> list[Task]:
        """The next ``n`` tasks (at most one of each: ``n`` is capped at their number)."""
        n = min(n, len(self.tasks))
        out: list[Task] = []
        ids: set[str] = set()
        while len(out) < n:
            if not self._order:
                order = list(self.tasks)
                if self.shuffle:
                    self._rng.shuffle(order)
                else:
                    order.reverse()
                self._order = order
            task_id = self._order.pop()
            if task_id in ids:  # a new pass began mid-batch: keep it for the next batch
                self._order.insert(0, task_id)
                continue
            ids.add(task_id)
            out.append(self.tasks[task_id])
        return out

    def state(self) -> dict[str, Any]:
        """A JSON-able position (for checkpoints)."""
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": list(self._order)}

    def restore(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._order = [t for t in state["order"] if t in self.tasks]


@dataclasses.dataclass(slots=True)
class RoundStats:
    """What the rounds behind one batch produced (reset by :meth:`Producer.take_stats`)."""

    rounds: int = 0
    prompts: int = 0
    episodes: int = 0
    completion_tokens: int = 0
    failed: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)
    busy_s: float = 0.0  # wall time with at least one round running
    peak_requests: int = 0  # generate calls in flight at once, at most


class Producer:
    """Plays rounds of ``round_size`` tasks into ``buffer`` with the current policy."""

    def __init__(
        self,
        env: Environment,
        stream: TaskStream,
        policy: Any,
        tokenizer: Tokenizer,
        buffer: Buffer,
        *,
        round_size: int,
        n_samples_per_prompt: int,
        sampling: SamplingParams,
        concurrency: int,
        seed: int,
        max_rounds: int = 8,
        max_failed_rounds: int = 3,
        episode_timeout: float | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        players: Any = None,
    ) -> None:
        if isinstance(policy, TextGenerator):
            raise ConfigError(
                f"{type(policy).__name__} is a text-level model (an OpenAI-compatible chat "
                "API): its samples are its replies re-tokenized here, not the tokens it "
                "sampled, and carry no log-probs, so no gradient can be computed from them. "
                "Evaluate it (agentenv eval --model openai:URL); train with the embedded "
                "engine, agentenv serve or an SGLang server"
            )
        self.env, self.stream, self.tokenizer = env, stream, tokenizer
        self.policy = _InFlight(policy, self)
        self.buffer = buffer
        self.round_size = round_size
        self.n_samples_per_prompt = n_samples_per_prompt
        self.sampling = sampling
        self.concurrency = concurrency
        self.seed = seed
        self.max_rounds = max_rounds
        self.max_failed_rounds = max_failed_rounds
        self._failed_rounds = 0  # rounds in a row in which every sample failed
        self.limits = Limits(timeout_s=episode_timeout)
        self.chat_template_kwargs: Mapping[str, Any] = chat_template_kwargs or {}
        # Rollout workers (trainer.distributed.RolloutWorkers) that play the rounds and put
        # their groups into the Buffer themselves; None: the rounds run here.
        self.players = players
        self.stats = RoundStats()
        self.groups_per_prompt = 1  # the Buffer keeps one group per role of an episode
        self.first_put = anyio.Event()
        self._barren = 0  # async: rounds in a row that kept no group
        self._running = 0
        self._busy_since = 0.0
        self.requests = 0  # generate calls in flight now
        # Shared by every round (async: several run at once): the engines' capacity.
        self.limiter = anyio.CapacityLimiter(concurrency)

    def _request_started(self) -> None:
        self.requests += 1
        self.stats.peak_requests = max(self.stats.peak_requests, self.requests)

    async def put_group(self, samples: Sequence[Sample]) -> None:
        """The runner's sink: counts the roles of a prompt's group, then into the Buffer."""
        roles = len({s.role for s in samples if s.role is not None})
        self.groups_per_prompt = max(self.groups_per_prompt, roles)
        await self.buffer.put_group(samples)
        self.first_put.set()

    def take_stats(self) -> RoundStats:
        out = self.stats
        if self._running:  # split the busy time of rounds still running
            now = time.perf_counter()
            out.busy_s += now - self._busy_since
            self._busy_since = now
        self.stats = RoundStats(peak_requests=self.requests)
        return out

    async def play(
        self, tasks: Sequence[Task], seed: int, round_sink: _RoundSink | None = None
    ) -> int:
        """One round: every task ``n_samples_per_prompt`` times, groups into the Buffer.
        Returns how many prompts' groups were put (all of them unless cancelled; a
        cancelled round's count is ``round_sink.put``)."""
        round_sink = round_sink or _RoundSink(self)
        if self._running == 0:
            self._busy_since = time.perf_counter()
        self._running += 1
        config = RolloutConfig(
            n_samples_per_prompt=self.n_samples_per_prompt,
            sampling=self.sampling,
            concurrency=self.concurrency,
            seed=seed,
            chat_template_kwargs=self.chat_template_kwargs,
            limits=self.limits,
            progress=False,
        )
        try:
            if self.players is None:
                result = await run_rollouts(
                    self.env, tasks, self.policy, tokenizer=self.tokenizer, sink=round_sink,
                    config=config,
                )  # fmt: skip
            else:  # the workers put the groups; the round's name (its seed) makes a re-run's
                # groups the same groups, which the Buffer takes once
                played = await self.players.play(tasks, config)
                result = played.stats
                round_sink.put += played.groups_put
                self.groups_per_prompt = max(self.groups_per_prompt, played.roles)
                if played.groups_put:
                    self.first_put.set()
        finally:
            self._running -= 1
            if self._running == 0:
                self.stats.busy_s += time.perf_counter() - self._busy_since
        s = self.stats
        s.rounds += 1
        s.prompts += len(tasks)
        s.episodes += result.episodes
        s.completion_tokens += result.completion_tokens
        s.failed += result.failed_episodes
        s.rewards.extend(result.rewards)
        self._count_failed(result)
        return round_sink.put

    def _count_failed(self, result: RolloutStats) -> None:
        """Stop the run after ``max_failed_rounds`` rounds in a row failed every sample:
        such a round keeps no group, so the rounds of a step (and every later step) would
        replay it -- the same failing requests -- without end."""
        if not result.all_failed:
            if result.samples:
                self._failed_rounds = 0
            return
        self._failed_rounds += 1
        if self._failed_rounds < self.max_failed_rounds:
            return
        reasons = "; ".join(f"{reason} (x{n})" for reason, n in result.top_failures(3))
        raise FailedRoundsError(
            f"{self._failed_rounds} rounds in a row failed every sample; the last round's "
            f"commonest reasons: {reasons}. Fix their cause (e.g. the reward service, the "
            "environment), or allow more such rounds with --max-failed-rounds"
        )

    async def fill(self, step: int, groups: int) -> None:
        """Play rounds until the kept groups of ``groups`` prompts are ready (at most
        ``max_rounds``).

        The first round's seed is ``seed + step`` (a run without filters reproduces the
        plain synchronous loop); later rounds of a step get seeds of their own.
        """
        for k in range(self.max_rounds):
            wanted = groups * self.groups_per_prompt
            await self.buffer.drop_stale()  # leftovers too old to train on do not count
            if (await self.buffer.statistics()).ready >= wanted:
                return
            missing = await self.buffer.prompts_to_start(wanted) // self.groups_per_prompt
            n = max(self.round_size, missing) if k else self.round_size
            await self.play(self.stream.take(n), self.seed + step + k * 1_000_003)

    async def run_forever(self, start: int = 0) -> None:
        """Start rounds as fast as the Buffer admits them (the asynchronous schedule),
        from training step ``start`` (it seeds the rounds: a resumed run plays new ones).

        Raises :class:`ConfigError` when ``max_rounds`` rounds in a row keep no group (a
        filter that drops everything, or episodes that all fail)."""
        k = 0
        async with anyio.create_task_group() as tg:
            while True:
                await self.buffer.reserve(self.round_size)
                tasks = self.stream.take(self.round_size)
                seed = self.seed + 1_000_003 * start + 7_919 * k
                tg.start_soon(self._admitted_round, tasks, seed)
                k += 1

    async def _admitted_round(self, tasks: Sequence[Task], seed: int) -> None:
        kept = (await self.buffer.statistics()).kept
        round_sink = _RoundSink(self)
        try:
            await self.play(tasks, seed, round_sink)
        finally:
            # Reservations of prompts that never arrived go back (cancelled at the end):
            # counted as they are put, so a cancelled round gives back only its own.
            await self.buffer.release(len(tasks) - round_sink.put)
        if (await self.buffer.statistics()).kept > kept:
            self._barren = 0
        else:
            self._barren += 1
            if self._barren >= self.max_rounds:
                stats = await self.buffer.statistics()
                raise ConfigError(
                    f"{self._barren} rounds in a row kept no group (dropped so far: "
                    f"{dict(stats.dropped)}, failed episodes: {self.stats.failed}): check the "
                    "dynamic-sampling filter and the episodes' errors"
                )


class _RoundSink:
    """One round's sink: counts the prompts whose groups it put, then the producer's."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.put = 0

    async def put_group(self, samples: Sequence[Sample]) -> None:
        await self.producer.put_group(samples)
        self.put += 1


class _InFlight:
    """The policy, with at most ``concurrency`` generate calls in flight over all rounds,
    counted (``rollout/peak_requests``)."""

    def __init__(self, policy: Any, producer: Producer) -> None:
        self.inner = policy
        self.producer = producer

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        async with self.producer.limiter:
            self.producer._request_started()
            try:
                completion: Completion = await self.inner.generate(input_ids, params, rid=rid)
                return completion
            finally:
                self.producer.requests -= 1
