"""The Environment API: tasks, the episode handle, and the base class.

An :class:`Environment` has one required coroutine, :meth:`Environment.rollout`, which
plays one episode of a :class:`Task` through an :class:`Episode` handle and returns its
samples. The handle creates token-exact transcripts, generates with the policy of each
role, and enforces the episode's limits. Everything else -- single-turn, multi-turn and
tool-use environments -- is a convenience built on this.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from agentenv._errors import (
    ConfigError,
    EpisodeAborted,
    EpisodeTruncated,
    at_least,
    positive,
    short_repr,
)
from agentenv._generator import Completion, Generator, SamplingParams
from agentenv._messages import Message
from agentenv._sample import JSONValue, Sample, Status
from agentenv._text_model import TextGenerator
from agentenv._tokenizer import Tokenizer
from agentenv._transcript import HistoryPolicy, Transcript

__all__ = ["DEFAULT_ROLE", "Environment", "Episode", "Limits", "Task", "resolve_sampling"]

log = logging.getLogger("agentenv.sampling")

DEFAULT_ROLE = "policy"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One prompt of an environment's dataset.

    Args:
        id: unique within the environment's split; GRPO groups are keyed by it.
        prompt: the opening user message, or full chat messages.
        answer: what the reward compares against (any JSON value).
        info: anything else the environment needs (tests, seeds, ...).
    """

    id: str
    prompt: str | Sequence[Mapping[str, Any]] = ""
    answer: JSONValue = None
    info: Mapping[str, JSONValue] = dataclasses.field(default_factory=dict)

    @staticmethod
    def check_all(tasks: Sequence[Any], source: str = "tasks") -> None:
        """Refuse anything in ``tasks`` that is not a :class:`Task`, naming ``source``
        (e.g. ``"MyEnv.tasks('train')"``) and the fix."""
        for i, task in enumerate(tasks):
            if not isinstance(task, Task):
                raise ConfigError(
                    f"{source} must be agentenv.Task objects, but item {i} is "
                    f"{type(task).__name__} {short_repr(task, 80)}; return "
                    "Task(id=..., prompt=..., answer=...) for each one"
                )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Per-episode limits.

    Args:
        max_turns: model turns per transcript (``None``: the environment's own limit).
        context_length: tokens per transcript; an episode that would exceed it ends
            as truncated. ``None``: unlimited.
        timeout_s: wall-clock limit for the whole episode; overrunning fails it.
    """

    max_turns: int | None = None
    context_length: int | None = None
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_turns is not None:
            at_least("max_turns", self.max_turns, 1)
        if self.context_length is not None:
            at_least("context_length", self.context_length, 2)
        if self.timeout_s is not None:
            positive("timeout_s", self.timeout_s)


def derive_seed(*parts: object, size: int = 4) -> int:
    """A seed of ``size`` bytes from ``parts``, the same in every process (unlike ``hash()``
    of a str), so runs are reproducible."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=size).digest()
    return int.from_bytes(digest, "little")


async def complete(
    generator: Generator, transcript: Transcript, params: SamplingParams, rid: str
) -> Completion:
    """``generator``'s completion of ``transcript``: of its ids, or of its messages for a
    chat API (:class:`TextGenerator`), with the tools the template would render."""
    if isinstance(generator, TextGenerator):
        tools = transcript.tools if transcript.tokenizer.supports_tools else None
        return await generator.generate_chat(transcript.messages, params, tools=tools, rid=rid)
    return await generator.generate(transcript.ids, params, rid=rid)


class Episode:
    """The handle a rollout uses: make transcripts, generate, build samples.

    ``policies`` maps roles to generators (the others play ``policy``: self-play);
    ``chat_template_kwargs`` are template arguments for every transcript of the episode.
    See docs/guide.md ("Environments").
    """

    # Slots: a run holds thousands of episodes in flight.
    __slots__ = (
        "chat_template_kwargs",
        "completion_tokens",
        "group_id",
        "index",
        "limits",
        "on_history_rewrite",
        "policies",
        "policy",
        "sampling",
        "seed",
        "task",
        "tokenizer",
        "transcripts",
    )

    def __init__(
        self,
        *,
        task: Task,
        tokenizer: Tokenizer,
        policy: Generator,
        policies: Mapping[str, Generator] | None = None,
        sampling: SamplingParams | None = None,
        limits: Limits | None = None,
        group_id: str | None = None,
        index: int = 0,
        seed: int | None = None,
        on_history_rewrite: HistoryPolicy = "new_sample",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.policy = policy
        self.policies: Mapping[str, Generator] = policies or {}
        self.sampling = sampling or SamplingParams()
        self.limits = limits or Limits()
        self.group_id = group_id if group_id is not None else task.id
        self.index = index
        self.seed = seed
        self.on_history_rewrite: HistoryPolicy = on_history_rewrite
        self.chat_template_kwargs: Mapping[str, Any] = chat_template_kwargs or {}
        self.transcripts: list[Transcript] = []
        self.completion_tokens = 0

    def transcript(
        self,
        messages: Iterable[Mapping[str, Any]] | str,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        role: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> Transcript:
        """A new transcript for ``role``, tracked by the episode (for truncation and failures).

        ``chat_template_kwargs`` are laid over the episode's for this transcript.
        """
        kwargs = self.chat_template_kwargs
        if chat_template_kwargs:
            kwargs = {**kwargs, **chat_template_kwargs}
        t = Transcript(
            self.tokenizer,
            messages,
            tools=tools,
            role=role,
            context_length=self.limits.context_length,
            on_history_rewrite=self.on_history_rewrite,
            chat_template_kwargs=kwargs,
        )
        self.transcripts.append(t)
        return t

    def generator_for(self, role: str | None) -> Generator:
        """The policy that plays ``role``."""
        return self.policies.get(role or DEFAULT_ROLE, self.policy)

    async def generate(
        self,
        transcript: Transcript,
        *,
        max_turns: int | None = None,
        **sampling: Any,
    ) -> Message:
        """One model turn on ``transcript``; returns the assistant message appended to it.

        ``sampling`` overrides the episode's :class:`SamplingParams` for this call.
        """
        limit = self.limits.max_turns if self.limits.max_turns is not None else max_turns
        if limit is not None and transcript.turns >= limit:
            raise EpisodeTruncated(f"max_turns: reached {limit} turns")
        params = self.sampling.replace(**sampling) if sampling else self.sampling
        if params.seed is None and self.seed is not None:
            # Each turn of each seeded episode draws its own reproducible random numbers.
            seed = derive_seed(self.seed, transcript.role, transcript.turns) & 0x7FFFFFFF
            params = params.replace(seed=seed)
        budget = self.limits.context_length
        if budget is not None:
            room = budget - transcript.num_tokens
            if room <= 0:
                raise EpisodeTruncated(
                    f"context: {transcript.num_tokens} tokens fill context_length {budget}"
                )
            if room < params.max_new_tokens:
                params = params.replace(
                    max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room)
                )
        rid = f"{self.group_id}/{self.index}/{transcript.role or DEFAULT_ROLE}/{transcript.turns}"
        if self.transcripts and transcript is not self.transcripts[0]:
            # Transcripts of one role may generate at once (parallel sub-agents): one rid each.
            rid = f"{rid}/{self.transcripts.index(transcript)}"
        completion = await complete(self.generator_for(transcript.role), transcript, params, rid)
        if completion.finish_reason.type == "abort" and not completion.output_ids:
            raise EpisodeAborted(completion.finish_reason.message or "generation aborted")
        message = transcript.add_completion(completion)
        self.completion_tokens += len(completion.output_ids)
        if completion.finish_reason.type == "abort":
            raise EpisodeAborted(completion.finish_reason.message or "generation aborted")
        return message

    def samples(
        self,
        transcript: Transcript,
        reward: float,
        *,
        status: Status = Status.COMPLETED,
        reason: str | None = None,
        metadata: Mapping[str, JSONValue] | None = None,
        advantage_scale: float = 1.0,
    ) -> list[Sample]:
        """The samples of ``transcript`` in this episode's group (``reward`` a number;
        ``True``/``False`` count as 1.0/0.0; ``advantage_scale``: :class:`Sample`'s)."""
        if isinstance(reward, bool):  # ``answer == label``: the common idiom
            reward = float(reward)
        return transcript.to_samples(
            reward, status=status, reason=reason, group_id=self.group_id, metadata=metadata,
            advantage_scale=advantage_scale,
        )  # fmt: skip


class Environment(abc.ABC):
    """Base class of every environment.

    Subclasses implement :meth:`rollout` (and usually :meth:`tasks`); ``name`` registers
    it for ``agentenv eval --env``. ``chat_template_kwargs`` (template arguments laid over
    the run's) and ``sampling`` (defaults of :class:`~agentenv.SamplingParams` fields
    that the run's explicit settings win over, :func:`resolve_sampling`) apply to every
    episode.
    """

    name: ClassVar[str] = ""
    chat_template_kwargs: ClassVar[Mapping[str, Any]] = {}
    sampling: ClassVar[Mapping[str, Any]] = {}
    # Methods the SDK awaits: a subclass that defines one without ``async`` is refused
    # when the class is defined, not in every episode as "can't be used in 'await'".
    _async_methods: ClassVar[tuple[str, ...]] = ("rollout", "score_group")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for method in cls._async_methods:
            fn = cls.__dict__.get(method)
            if fn is None or getattr(fn, "__isabstractmethod__", False):
                continue
            if not inspect.iscoroutinefunction(fn):
                raise ConfigError(
                    f"{cls.__name__}.{method} must be a coroutine function: write "
                    f"`async def {method}(...)` (the SDK awaits it)"
                )

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the fix if the environment cannot run as
        configured. The runner calls it once, before the first episode (default: no check)."""
        return None

    def tasks(self, split: str = "train") -> Sequence[Task]:
        """The tasks of ``split`` (``"train"`` or ``"test"``)."""
        raise ConfigError(
            f"{type(self).__name__} does not provide tasks; override tasks(split) or pass "
            "tasks to the runner explicitly"
        )

    @abc.abstractmethod
    async def rollout(self, task: Task, episode: Episode) -> Sample | Sequence[Sample]:
        """Play one episode of ``task`` and return its samples."""

    async def score_group(self, task: Task, samples: Sequence[Sample]) -> Sequence[Sample]:
        """Adjust the rewards of a finished group (default: unchanged). Failed samples excluded."""
        return samples


def resolve_sampling(
    env: Environment, base: SamplingParams, given: Mapping[str, str] | None = None
) -> SamplingParams:
    """The sampling parameters a run of ``env`` generates with (``agentenv eval``,
    ``agentenv train``, :func:`agentenv.run`): a field given explicitly wins over the
    environment's ``sampling`` attribute, which wins over ``base``'s defaults.

    ``given`` maps the fields of ``base`` given explicitly to how, for the warning (logger
    ``agentenv.sampling``) when the environment sets another value:
    ``{"max_new_tokens": "--max-new-tokens 32"}``.

    Raises:
        ConfigError: the environment's ``sampling`` is not a mapping of
            :class:`SamplingParams` fields with valid values.
    """
    given = given or {}
    owner = f"{type(env).__name__}.sampling"
    own = getattr(env, "sampling", None) or {}
    if not isinstance(own, Mapping):
        raise ConfigError(
            f"{owner} must be a mapping of SamplingParams fields (e.g. "
            f"{{'max_new_tokens': 512}}), got {short_repr(own)}"
        )
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(str(k) for k in own if k not in fields)
    if unknown:
        raise ConfigError(
            f"{owner} names {unknown}, which are not sampling parameters; "
            f"SamplingParams fields: {sorted(fields)}"
        )
    for name, value in own.items():
        if name in given and getattr(base, name) != value:
            log.warning(
                "%s wins over %s's %s=%r (a setting given explicitly wins over the "
                "environment's sampling)", given[name], owner, name, value,
            )  # fmt: skip
    try:
        return base.replace(**{k: v for k, v in own.items() if k not in given})
    except ConfigError as e:
        raise ConfigError(f"{owner}: {e}") from None
