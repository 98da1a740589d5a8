"""The rollout runner: many episodes at once, grouped, with failures as data.

:func:`run_rollouts` plays ``n_samples_per_prompt`` episodes of every task on a fixed pool
of ``concurrency`` worker tasks and puts each finished group, scored by the environment's
group rewards, into the sink. An episode that raises, overruns its timeout or returns a
bad reward is a *failed sample*; its siblings carry on (docs/guide.md, "Running rollouts")."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import sysconfig
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import anyio

from agentenv._environment import (
    Environment,
    Episode,
    Limits,
    Task,
    derive_seed,
    resolve_sampling,
)
from agentenv._errors import (
    AgentEnvError,
    ClosedResourceError,
    ConfigError,
    EpisodeAborted,
    EpisodeTruncated,
    RewardError,
    at_least,
)
from agentenv._generator import Generator, SamplingParams
from agentenv._sample import Sample, Status
from agentenv._text_model import TextGenerator
from agentenv._tokenizer import Tokenizer, check_template_kwargs
from agentenv._transcript import HistoryPolicy

__all__ = [
    "JsonlSink",
    "ListSink",
    "RolloutConfig",
    "RolloutStats",
    "SampleSink",
    "run_rollouts",
]

_MAX_REASON = 1000
_TOP_REASONS = 5


@runtime_checkable
class SampleSink(Protocol):
    """Where finished groups go. The Data Buffer implements this.

    A group is every sample of one task's ``n_samples_per_prompt`` episodes, failed ones
    included, in episode order; it arrives whole, so group-level logic (GRPO baselines,
    filters) never sees half a group.
    """

    async def put_group(self, samples: Sequence[Sample]) -> None:
        """Accept one finished group (may wait: backpressure)."""
        ...


class ListSink:
    """Collects samples in memory (tests, small evaluations)."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    async def put_group(self, samples: Sequence[Sample]) -> None:
        self.samples.extend(samples)


class JsonlSink:
    """Appends each sample as one JSON line to a file; use as a context manager."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("w", encoding="utf-8")
        self.count = 0

    async def put_group(self, samples: Sequence[Sample]) -> None:
        if self._file is None:
            raise ClosedResourceError(f"JsonlSink({str(self.path)!r}) is closed")
        self._file.write("".join(s.to_json() + "\n" for s in samples))
        self.count += len(samples)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> JsonlSink:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RolloutConfig:
    """How to run rollouts.

    Args:
        n_samples_per_prompt: episodes per task (the GRPO group size).
        concurrency: episodes in flight at once.
        sampling: sampling parameters for every generation, used as they are; ``None``:
            the environment's ``sampling`` attribute over :class:`SamplingParams`'
            defaults (:func:`~agentenv.resolve_sampling` builds one that keeps the
            environment's values for the fields not given).
        limits: per-episode turn, context and time limits.
        seed: base seed; episode ``i`` of task ``t`` gets a seed derived from it, and each
            of its model turns samples with a seed derived from that (unless
            ``sampling.seed`` is set), so a rollout on the embedded engine is reproducible.
        on_history_rewrite: what transcripts do when the template rewrites history.
        chat_template_kwargs: template arguments for every render (SGLang's and vLLM's
            name), e.g. Qwen3's ``{"enable_thinking": False}``; an environment's own
            ``chat_template_kwargs`` are laid over them.
        progress: show a progress bar on stderr (``None``: when stderr is a terminal).
        run_id: names the run's groups (``{task id}@{run_id}``); default a random one. The
            same ``run_id`` and ``seed`` play the same groups again -- what a round re-run
            after its worker died gives, so the Buffer can take each group once.
    """

    n_samples_per_prompt: int = 1
    concurrency: int = 64
    sampling: SamplingParams | None = None
    limits: Limits = dataclasses.field(default_factory=Limits)
    seed: int = 0
    on_history_rewrite: HistoryPolicy = "new_sample"
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    progress: bool | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        kwargs = check_template_kwargs(self.chat_template_kwargs)
        object.__setattr__(self, "chat_template_kwargs", kwargs)
        at_least("n_samples_per_prompt", self.n_samples_per_prompt, 1)
        at_least("concurrency", self.concurrency, 1)


@dataclasses.dataclass(slots=True)
class RolloutStats:
    """What a run produced."""

    episodes: int = 0
    samples: int = 0
    turns: int = 0
    completion_tokens: int = 0
    failed: Counter[str] = dataclasses.field(default_factory=Counter)
    #: Episodes with a failed sample (a failed episode keeps a sample per segment it played).
    failed_episodes: int = 0
    status: Counter[str] = dataclasses.field(default_factory=Counter)
    rewards: list[float] = dataclasses.field(default_factory=list)
    failure_reasons: Counter[str] = dataclasses.field(default_factory=Counter)
    wall_s: float = 0.0

    @property
    def all_failed(self) -> bool:
        """Whether there were samples and every one of them failed."""
        return self.samples > 0 and self.status.get(Status.FAILED.value, 0) == self.samples

    def top_failures(self, k: int = _TOP_REASONS) -> list[tuple[str, int]]:
        """The ``k`` commonest reasons of failed samples, with their counts."""
        return self.failure_reasons.most_common(k)

    @property
    def reward_mean(self) -> float:
        return math.fsum(self.rewards) / len(self.rewards) if self.rewards else 0.0

    @property
    def reward_std(self) -> float:
        if not self.rewards:
            return 0.0
        mean = self.reward_mean
        return math.sqrt(math.fsum((r - mean) ** 2 for r in self.rewards) / len(self.rewards))

    def to_dict(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "samples": self.samples,
            "turns": self.turns,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            "failed": dict(sorted(self.failed.items())),
            "failed_episodes": self.failed_episodes,
            "failure_reasons": [[reason, n] for reason, n in self.top_failures()],
            "status": dict(sorted(self.status.items())),
            "completion_tokens": self.completion_tokens,
            "wall_s": round(self.wall_s, 4),
        }


def failed_samples(
    episode: Episode, error: BaseException, *, error_type: str | None = None
) -> list[Sample]:
    """The failed samples of ``episode``, naming ``error``: one per segment with a model
    turn, keeping what it recorded before the failure (never trained on: see
    docs/guide.md, "Running rollouts"); without one, a sample with the first prompt."""
    reason = describe_error(error)
    kind = error_type or type(error).__name__
    out: list[Sample] = []
    for t in episode.transcripts:
        out += t.to_samples(
            0.0,
            status=Status.FAILED,
            reason=reason,
            error_type=kind,
            group_id=episode.group_id,
        )
    if out:
        return out
    prompt: list[int] = []
    role = None
    if episode.transcripts:
        first = episode.transcripts[0]
        prompt = list(first.segments[0].prompt_ids)
        role = first.role
    return [
        Sample(
            prompt_ids=prompt,
            completion_ids=[],
            reward=0.0,
            group_id=episode.group_id,
            role=role,
            status=Status.FAILED,
            reason=reason,
            error_type=kind,
            metadata={"turns": 0},
        )
    ]


def describe_error(error: BaseException) -> str:
    """The reason a failed sample gives for ``error``, at most ``_MAX_REASON`` characters:
    an agentenv error's message as it is; any other exception's type, message and the
    innermost frame of the environment's code (``KeyError: 'answer' (at my_env.py:12 in
    correct)``)."""
    message = str(error) or repr(error)
    if isinstance(error, AgentEnvError) or error.__traceback__ is None:
        return message[:_MAX_REASON]  # ours, or made by the runner (an episode's timeout)
    where = _raising_frame(error)
    suffix = f" (at {where})" if where else ""
    head = f"{type(error).__name__}: {message}"
    return head[: _MAX_REASON - len(suffix)] + suffix


def _raising_frame(error: BaseException) -> str | None:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    library = [str(Path(__file__).parent)]  # agentenv itself
    library += {sysconfig.get_path(k) for k in ("stdlib", "purelib", "platlib")}
    own = [f for f in frames if not any(f.filename.startswith(d) for d in library if d)]
    frame = (own or frames)[-1]
    path = Path(frame.filename)
    try:
        shown = str(path.relative_to(Path.cwd()))
    except ValueError:
        shown = str(path)
    return f"{shown}:{frame.lineno} in {frame.name}"


def policy_tokenizer(policy: Generator) -> Tokenizer:
    """The tokenizer that renders transcripts for ``policy``: the chat tokenizer it carries
    (a :class:`ScriptedModel`'s), or the one beside its model (the embedded engine).

    Raises:
        ConfigError: when ``policy`` has neither (a server client): pass ``tokenizer=``.
    """
    own = getattr(policy, "tokenizer", None)
    if own is not None and all(hasattr(own, a) for a in ("render", "encode", "decode")):
        return own  # type: ignore[no-any-return]
    model_path = getattr(policy, "model_path", None)
    if model_path is not None and Path(model_path, "tokenizer.json").is_file():
        from agentenv._tokenizer import ChatTokenizer

        return ChatTokenizer.load(str(model_path))
    raise ConfigError(
        f"cannot tell the tokenizer of {type(policy).__name__}: pass "
        'tokenizer=ChatTokenizer.load("<model name or directory>")'
    )


def _limit_samples(episode: Episode, status: Status, reason: str) -> list[Sample]:
    # A custom rollout let a truncation/abort escape: emit what its transcripts hold.
    out: list[Sample] = []
    for t in episode.transcripts:
        out.extend(episode.samples(t, 0.0, status=status, reason=reason))
    return out


async def play_episode(env: Environment, episode: Episode) -> list[Sample]:
    """Run one episode; every outcome, including errors, comes back as samples."""
    timeout = episode.limits.timeout_s
    deadline: anyio.CancelScope | None = None
    try:
        if timeout is None:  # a cancel scope is not free; skip it when there is no limit
            result = await env.rollout(episode.task, episode)
        else:
            with anyio.fail_after(timeout) as deadline:
                result = await env.rollout(episode.task, episode)
        samples = [result] if isinstance(result, Sample) else list(result)
        if not samples:
            raise ConfigError(f"{type(env).__name__}.rollout returned no samples")
        for s in samples:
            if not isinstance(s, Sample):
                raise ConfigError(
                    f"{type(env).__name__}.rollout must return Sample objects, "
                    f"got {type(s).__name__}"
                )
            if s.group_id is None:
                s.group_id = episode.group_id
    except EpisodeTruncated as e:
        samples = _limit_samples(episode, Status.TRUNCATED, e.reason)
    except EpisodeAborted as e:
        samples = _limit_samples(episode, Status.ABORTED, str(e) or "aborted")
    except TimeoutError as e:
        if deadline is None or not deadline.cancelled_caught:  # the environment's own
            return failed_samples(episode, e)
        error = TimeoutError(f"episode exceeded its {timeout} s timeout")
        return failed_samples(episode, error, error_type="EpisodeTimeout")
    except Exception as e:
        return failed_samples(episode, e)
    return samples or failed_samples(episode, ConfigError("episode produced no model turn"))


@dataclasses.dataclass(slots=True)
class _Group:
    task: Task
    group_id: str
    pending: int
    samples: list[Sample] = dataclasses.field(default_factory=list)


def _progress_bar(enabled: bool | None, total: int, desc: str) -> Any:
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(
        total=total,
        desc=desc,
        unit="ep",
        disable=not show,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )


async def run_rollouts(
    env: Environment,
    tasks: Sequence[Task],
    policy: Generator,
    *,
    tokenizer: Tokenizer | None = None,
    sink: SampleSink | None = None,
    config: RolloutConfig | None = None,
    policies: Mapping[str, Generator] | None = None,
) -> RolloutStats:
    """Play every task ``n_samples_per_prompt`` times and put the samples into ``sink``.

    Args:
        env: the environment.
        tasks: the tasks to play (e.g. ``env.tasks("test")[:100]``).
        policy: the generator for every role not in ``policies``.
        tokenizer: the policy's tokenizer (renders transcripts); default: the policy's
            own (a :class:`ScriptedModel`'s, the embedded engine's model directory).
        sink: receives each group's samples as soon as the group finishes: groups in the
            order they complete (not the order of ``tasks``), samples in episode order
            within a group; without one the samples are counted in the stats and dropped
            (:func:`agentenv.run` returns them, in task order).
        config: group size, concurrency, sampling, limits, seed, progress bar.
        policies: per-role generators (fixed opponents, other models).
    """
    config = config or RolloutConfig()
    sink = sink if sink is not None else ListSink()
    Task.check_all(tasks, "the tasks of a run")
    env.check()
    tok = (
        tokenizer
        if tokenizer is not None
        else await anyio.to_thread.run_sync(policy_tokenizer, policy)
    )
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        dupes = sorted(k for k, v in Counter(ids).items() if v > 1)[:5]
        raise ConfigError(f"task ids must be unique within a run; duplicated: {dupes}")
    n = config.n_samples_per_prompt
    run = config.run_id or uuid.uuid4().hex[:8]
    groups = [_Group(task, f"{task.id}@{run}", n) for task in tasks]
    stats = RolloutStats()
    start = time.perf_counter()
    template_kwargs = {
        **config.chat_template_kwargs,
        **check_template_kwargs(getattr(env, "chat_template_kwargs", None) or {}),
    }
    bar = _progress_bar(config.progress, len(tasks) * n, getattr(env, "name", "") or "rollout")
    sampling = config.sampling or resolve_sampling(env, SamplingParams())

    async def finish(group: _Group) -> None:
        ok = [s for s in group.samples if s.status is not Status.FAILED]
        bad = [s for s in group.samples if s.status is Status.FAILED]
        if ok:
            deadline: anyio.CancelScope | None = None
            try:  # group rewards are bounded like an episode: by the episode timeout
                with anyio.fail_after(config.limits.timeout_s) as deadline:
                    ok = list(await env.score_group(group.task, ok))
            except Exception as e:
                error: Exception = e
                if deadline is not None and deadline.cancelled_caught:
                    error = RewardError(
                        f"exceeded the episode timeout of {config.limits.timeout_s} s"
                    )
                ok = [
                    dataclasses.replace(
                        s,
                        status=Status.FAILED,
                        reason=f"group reward: {describe_error(error)}"[:_MAX_REASON],
                        error_type=type(error).__name__,
                        reward=0.0,
                        metadata=dict(s.metadata),
                    )
                    for s in ok
                ]
        out = sorted([*ok, *bad], key=lambda s: s.episode or 0)  # stable: episode order
        stats.failed_episodes += len({s.episode for s in out if s.status is Status.FAILED})
        for s in out:
            stats.samples += 1
            stats.status[s.status.value] += 1
            if s.status is Status.FAILED:
                stats.failed[s.error_type or "Error"] += 1
                kind, reason = s.error_type or "Error", s.reason or ""
                key = reason if reason.startswith(f"{kind}:") else f"{kind}: {reason}"
                stats.failure_reasons[key[:200]] += 1
            else:
                stats.rewards.append(s.reward)
        group.samples.clear()
        await sink.put_group(out)

    # One lazy iterator shared by the workers: next() never suspends, so no two workers
    # can take the same item, and no channel is needed.
    items = ((group, i) for group in groups for i in range(n))

    async def worker() -> None:
        for group, i in items:
            episode = Episode(
                task=group.task,
                tokenizer=tok,
                policy=policy,
                policies=policies,
                sampling=sampling,
                limits=config.limits,
                group_id=group.group_id,
                index=i,
                seed=derive_seed(config.seed, group.task.id, i),
                on_history_rewrite=config.on_history_rewrite,
                chat_template_kwargs=template_kwargs,
            )
            samples = await play_episode(env, episode)
            for k, s in enumerate(samples):
                s.id = s.id or f"{group.group_id}/{i}/{k}"
                s.task_id = s.task_id or group.task.id
                s.episode = i if s.episode is None else s.episode
                if isinstance(episode.generator_for(s.role), TextGenerator):
                    s.metadata["token_exact"] = False  # re-tokenized text: never trained on
            stats.episodes += 1
            stats.turns += sum(t.turns for t in episode.transcripts)
            stats.completion_tokens += episode.completion_tokens
            group.samples.extend(samples)
            group.pending -= 1
            bar.update(1)
            if group.pending == 0:
                await finish(group)

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(min(config.concurrency, max(1, len(tasks) * n))):
                tg.start_soon(worker)
    finally:
        bar.close()
        stats.wall_s = time.perf_counter() - start
    return stats
