"""The data side of the training loop: tasks in a seeded order, rollouts into the Buffer.

:class:`TaskStream` hands out tasks (reshuffled each pass, if asked) and saves and
restores its position. :class:`Producer` plays rounds into the Buffer: ``fill`` until a
batch of kept groups is ready, or ``run_forever`` on the asynchronous schedule, where the
Buffer's admission control bounds staleness. A round's groups are named by its seed
(``{task id}@s{seed}``); with a durable Buffer the producer keeps a note there
(:data:`NOTE`) before each round starts, so that a resumed run plays only the groups of
unfinished rounds that the Buffer does not hold (docs/trainer.md, "The run's Buffer").
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from agentenv import (
    AgentEnvError,
    Completion,
    ConfigError,
    Environment,
    Generator,
    RolloutStats,
    Sample,
    SamplingParams,
    Task,
    TextGenerator,
    Tokenizer,
    run_rollouts,
)
from agentenv.buffer import Buffer

if TYPE_CHECKING:
    from trainer.config import GRPOConfig
    from trainer.distributed import RolloutWorkers

__all__ = ["NOTE", "FailedRoundsError", "Producer", "RoundStats", "TaskStream"]

#: The key of the producer's note in a durable Buffer.
NOTE = "producer"


class FailedRoundsError(AgentEnvError):
    """``max_failed_rounds`` rounds in a row failed every sample: the run stops, naming
    the commonest reasons, rather than replaying them."""


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
    """Plays rounds of ``config.round_size`` tasks into ``buffer`` with the current
    policy, as the loop's group of the config says (``config``: the episodes of a prompt,
    their sampling, timeout and template arguments, the seed, the rounds' bounds);
    ``concurrency``: episodes in flight (:meth:`GRPOConfig.concurrency_for`)."""

    def __init__(
        self,
        env: Environment,
        stream: TaskStream,
        policy: Generator,
        tokenizer: Tokenizer,
        buffer: Buffer,
        config: GRPOConfig,
        *,
        concurrency: int,
        players: RolloutWorkers | None = None,
        max_groups_per_prompt: int | None = None,
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
        self.round_size = config.round_size
        self.seed = config.seed
        self.max_rounds = config.max_rounds
        self.max_failed_rounds = config.max_failed_rounds
        self.rollout = config.rollout_config(concurrency)  # each round's, less its seed
        self._failed_rounds = 0  # rounds in a row in which every sample failed
        # Rollout workers (trainer.distributed.RolloutWorkers) that play the rounds and put
        # their groups into the Buffer themselves; None: the rounds run here.
        self.players = players
        self.stats = RoundStats()
        self.groups_per_prompt = 1  # the Buffer keeps one group per role of an episode
        # The roles a prompt may have: the Buffer's capacity was sized for them.
        self.max_groups_per_prompt = max_groups_per_prompt
        # With a durable Buffer: the rounds started and not yet played (seed -> task ids),
        # kept in its note with the stream's position; and the async schedule's next round.
        self.notes = buffer.path is not None
        self.open: dict[int, list[str]] = {}
        self.next_round: tuple[int, int] | None = None
        self.schedule: dict[str, Any] = {}  # what a resumed run must share (the note's)
        self._note_lock = anyio.Lock()  # notes written in the order their states were
        self.first_put = anyio.Event()
        self._barren = 0  # async: rounds in a row that kept no group
        self._running = 0
        self._busy_since = 0.0
        self.requests = 0  # generate calls in flight now
        # Shared by every round (async: several run at once): the engines' capacity.
        self.limiter = anyio.CapacityLimiter(concurrency)

    async def put_group(self, samples: Sequence[Sample]) -> None:
        """The runner's sink: counts the roles of a prompt's group, then into the Buffer."""
        self._count_roles(len({s.role for s in samples if s.role is not None}))
        await self.buffer.put_group(samples)
        self.first_put.set()

    def _count_roles(self, roles: int) -> None:
        bound = self.max_groups_per_prompt
        if bound is not None and roles > bound:
            raise ConfigError(
                f"an episode gave samples of {roles} roles, but the Buffer was sized for "
                f"{bound} group(s) per prompt: list every role in the environment's "
                "`roles` attribute (a tuple of their names)"
            )
        self.groups_per_prompt = max(self.groups_per_prompt, roles)

    # -- the note in a durable Buffer -------------------------------------------------------
    async def resume(self, schedule: Mapping[str, Any]) -> bool:
        """Take up where the producer's note in the Buffer says it stood (the stream, the
        rounds not finished, the async schedule's next round); ``False`` when there is none.
        A note of another ``schedule`` (batch settings, seed) is refused."""
        self.schedule = dict(schedule)
        if not self.notes:
            return False
        note = await self.buffer.note(NOTE)
        if note is None:
            return False
        if note.get("schedule") != self.schedule:
            raise ConfigError(
                f"cannot resume the Buffer at {str(self.buffer.path)!r} with another "
                f"schedule: its rounds were played for {note.get('schedule')}, this run has "
                f"{dict(schedule)}; use another --save directory"
            )
        self.stream.restore(note["stream"])
        self.open = {int(seed): list(ids) for seed, ids in note["open"]}
        self.next_round = tuple(note["next_round"]) if note.get("next_round") else None
        self.groups_per_prompt = max(self.groups_per_prompt, int(note["groups_per_prompt"]))
        return True

    async def _begin(self, tasks: Sequence[Task], seed: int) -> None:
        """Note a round about to start (after its tasks were taken from the stream)."""
        if not self.notes:
            return
        self.open[seed] = [t.id for t in tasks]
        async with self._note_lock:  # the state as it is once the previous note is written
            await self.buffer.set_note(
                NOTE,
                {
                    "schedule": self.schedule,
                    "stream": self.stream.state(),
                    "open": [[seed, ids] for seed, ids in self.open.items()],
                    "next_round": list(self.next_round) if self.next_round else None,
                    "groups_per_prompt": self.groups_per_prompt,
                },
            )

    async def _missing(self, seed: int, ids: Sequence[str]) -> list[Task]:
        """The tasks of an unfinished round whose groups the Buffer does not hold."""
        names = {t: f"{t}@s{seed}" for t in ids if t in self.stream.tasks}
        stored = await self.buffer.known_groups(list(names.values()))
        return [self.stream.tasks[t] for t, name in names.items() if name not in stored]

    async def replay_open(self) -> None:
        """Play what the rounds that were unfinished when the run stopped did not put (their
        own seeds: the groups a straight run would have put), one after the other."""
        for seed, ids in list(self.open.items()):
            missing = await self._missing(seed, ids)
            if missing:
                await self.play(missing, seed)
            else:
                self.open.pop(seed, None)

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
        # A round played again names the same groups (its run id is its seed's).
        config = dataclasses.replace(self.rollout, seed=seed, run_id=f"s{seed}")
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
                self._count_roles(played.roles)
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
        # Every group of the round is in the Buffer. The next round's note says so; until
        # then a resume finds them all stored and plays nothing of it (one sync fewer).
        self.open.pop(seed, None)
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
            stats = await self.buffer.statistics()
            if stats.ready >= wanted:
                return
            missing = await self.buffer.prompts_to_start(wanted) // self.groups_per_prompt
            # Never more than the Buffer has room for: it holds a round beside less than a
            # batch (BufferConfig.capacity, from GRPOConfig.buffer_config).
            room = (self.buffer.config.capacity - stats.ready) // self.groups_per_prompt
            n = max(self.round_size, min(missing, room)) if k else self.round_size
            tasks, seed = self.stream.take(n), self.seed + step + k * 1_000_003
            await self._begin(tasks, seed)
            await self.play(tasks, seed)

    async def run_forever(self, start: int = 0) -> None:
        """Start rounds as fast as the Buffer admits them (the asynchronous schedule),
        from training step ``start`` (it seeds the rounds: a resumed run plays new ones).

        Raises :class:`ConfigError` when ``max_rounds`` rounds in a row keep no group (a
        filter that drops everything, or episodes that all fail)."""
        # A resumed run continues the rounds of the one it resumes (its note says where).
        start, k = self.next_round or (start, 0)
        async with anyio.create_task_group() as tg:
            for seed, ids in list(self.open.items()):  # what the stopped run did not put
                missing = await self._missing(seed, ids)
                if missing:
                    await self.buffer.reserve(len(missing))
                    tg.start_soon(self._admitted_round, missing, seed)
                else:
                    self.open.pop(seed, None)
            while True:
                await self.buffer.reserve(self.round_size)
                tasks = self.stream.take(self.round_size)
                seed = self.seed + 1_000_003 * start + 7_919 * k
                k += 1
                self.next_round = (start, k)
                await self._begin(tasks, seed)
                tg.start_soon(self._admitted_round, tasks, seed)

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

    def __init__(self, policy: Generator, producer: Producer) -> None:
        self.inner = policy
        self.producer = producer

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        async with self.producer.limiter:
            producer = self.producer
            producer.requests += 1
            producer.stats.peak_requests = max(producer.stats.peak_requests, producer.requests)
            try:
                completion: Completion = await self.inner.generate(input_ids, params, rid=rid)
                return completion
            finally:
                self.producer.requests -= 1
