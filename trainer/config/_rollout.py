"""The rollout group of the training config (:class:`GRPOConfig`): what each step plays
and how the loop schedules it, slime's flags. Light (no torch): ``agentenv train``
validates it (the batch identity included) before anything loads; :func:`trainer.run_grpo`
runs it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self

import pydantic

from agentenv import ConfigError, Limits, RolloutConfig, SamplingParams, Task, resolve_name
from trainer.config._settings import Group, flags, setting

if TYPE_CHECKING:
    from agentenv.buffer import BufferConfig, GroupFilter

__all__ = ["SCHEDULES", "GRPOConfig", "filter_name", "load_filter"]


class _Engine(Protocol):
    """What the rollout group reads of a :class:`~trainer.RolloutEngine` (the settings
    sit below the engines, so they name only these two properties)."""

    @property
    def capacity(self) -> int | None: ...

    @property
    def device(self) -> str | None: ...


Schedule = Literal["sync", "one_step_off", "async"]
SCHEDULES: tuple[str, ...] = ("sync", "one_step_off", "async")


def load_filter(path: str) -> GroupFilter:
    """``module:name`` or ``module.name``: a group filter, or a class built without
    arguments (``agentenv.buffer.RewardStdFilter``)."""
    found = resolve_name(path, what="--dynamic-sampling-filter-path", kind="function")
    if isinstance(found, type):
        found = found()
    if not callable(found):
        raise ConfigError(f"--dynamic-sampling-filter-path {path!r} is not callable")
    filt: GroupFilter = found
    return filt


def filter_name(filt: object) -> str:
    """A filter as ``module:name`` (an instance: its class's)."""
    owner = filt if callable(filt) and hasattr(filt, "__qualname__") else type(filt)
    return f"{owner.__module__}:{getattr(owner, '__qualname__', repr(owner))}"


class GRPOConfig(Group):
    """The loop's schedule (``config.rollout``; slime's flags).

    ``rollout_batch_size × n_samples_per_prompt`` must equal
    ``global_batch_size × num_steps_per_rollout``: every sample of a rollout is trained
    on exactly once. ``concurrency`` defaults to what the engine decodes together
    (:meth:`concurrency_for`); ``max_rounds`` bounds the rounds of a step while filters
    drop groups (``sync`` and ``one_step_off`` then train on what they have, ``async``
    stops with an error after that many barren rounds in a row); ``filters`` takes group
    filters (``RewardStdFilter()``) or their ``module:name``.
    """

    num_rollout: int = setting("--num-rollout", 10, "rollout steps", ge=1)
    rollout_batch_size: int = setting("--rollout-batch-size", 8, "prompts per rollout step", ge=1)
    n_samples_per_prompt: int = setting("--n-samples-per-prompt", 4, "episodes per prompt", ge=1)
    global_batch_size: int | None = setting(
        "--global-batch-size", None, "samples per optimizer step (default: a whole rollout)", ge=1
    )
    num_steps_per_rollout: int = setting(
        "--num-steps-per-rollout", 1, "optimizer steps per rollout", ge=1
    )
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"] = (
        setting("--advantage-estimator", "grpo", "advantage estimator")
    )
    sampling: SamplingParams = setting(
        None,
        default_factory=lambda: SamplingParams(max_new_tokens=128, temperature=1.0),
        sub={
            "max_new_tokens": ("--rollout-max-response-len", "tokens per turn"),
            "temperature": ("--rollout-temperature", "sampling temperature (0: greedy)"),
            "top_p": ("--rollout-top-p", "nucleus sampling: the top tokens of this mass"),
            "top_k": ("--rollout-top-k", "sample among the k likeliest tokens (-1: all)"),
        },
    )
    concurrency: int | None = setting(None, None, "episodes in flight", ge=1)
    seed: int = setting("--rollout-seed", 0, "seed of task order and sampling")
    schedule: Schedule = setting(
        "--schedule", "sync", "sync, one_step_off (rollout overlaps training) or async"
    )
    max_staleness: int = setting(
        "--max-staleness", 1, "oldest policy version a batch may hold, behind the trainer "
        "(older groups are dropped; one_step_off needs >= 1)", ge=0,
    )  # fmt: skip
    offload_rollout: bool | None = setting(
        "--offload-rollout", None, "the embedded engine gives its memory back while each "
        "step trains (its key/value cache, on CPU its weights too; the weight sync loads "
        "them again): --schedule sync only; default on for an engine on CPU",
    )  # fmt: skip
    over_sampling_batch_size: int | None = setting(
        "--over-sampling-batch-size", None,
        "prompts started per round (>= --rollout-batch-size; default: it)", ge=1,
    )  # fmt: skip
    filters: tuple[Any, ...] = setting(
        "--dynamic-sampling-filter-path", (),
        "group filter, module:function or module.function (samples -> keep?); "
        "'agentenv.buffer.RewardStdFilter' drops groups with equal rewards",
        metavar="FUNCTION",
    )  # fmt: skip
    max_rounds: int = setting(None, 8, "rounds per step at most while filters drop groups", ge=1)
    max_failed_rounds: int = setting(
        "--max-failed-rounds", 3, "stop the run with the failures' reasons after this many "
        "rounds in a row in which every sample failed", ge=1,
    )  # fmt: skip
    episode_timeout: float | None = setting(
        "--episode-timeout", 600.0, "seconds an episode may take (its rewards included) "
        "before it fails as a sample naming the timeout, as in agentenv eval", gt=0,
    )  # fmt: skip
    shuffle: bool = setting("--rollout-shuffle", True, "reshuffle the tasks at each pass")
    chat_template_kwargs: dict[str, Any] = setting(
        "--apply-chat-template-kwargs", default_factory=dict,
        doc='JSON object of chat-template arguments, e.g. {"enable_thinking": false}',
    )  # fmt: skip

    # The fields of ``sampling`` given explicitly (flags, a config file, Python): they win
    # over the environment's ``sampling`` attribute (:meth:`for_env`), which is laid over
    # the rest once (a resolved config is not resolved, nor warned about, again).
    _sampling_given: frozenset[str] = pydantic.PrivateAttr(default=frozenset())
    _sampling_resolved: bool = pydantic.PrivateAttr(default=False)

    @pydantic.model_validator(mode="wrap")
    @classmethod
    def _remember_given_sampling(cls, data: Any, handler: Any) -> Any:
        config = handler(data)
        given = data.get("sampling") if isinstance(data, Mapping) else None
        if isinstance(given, Mapping):
            config._sampling_given = frozenset(given)
        elif isinstance(given, SamplingParams):  # a whole record: every field of it
            config._sampling_given = frozenset(f.name for f in dataclasses.fields(given))
        return config

    @property
    def sampling_given(self) -> frozenset[str]:
        """The fields of :attr:`sampling` given explicitly (the rest are defaults)."""
        return self._sampling_given

    def for_env(self, env: Any) -> GRPOConfig:
        """This config with ``env``'s ``sampling`` attribute in place of the sampling
        fields not given explicitly (:func:`agentenv.resolve_sampling`: what was given
        wins, and a disagreement is logged naming both values); the same config once
        resolved."""
        if self._sampling_resolved:
            return self
        from agentenv import resolve_sampling

        names = {f.path[1]: f.name for f in flags(GRPOConfig) if f.path[0] == "sampling"}
        given = {
            k: f"{names.get(k, f'sampling.{k}')} {getattr(self.sampling, k)}"
            for k in self._sampling_given
        }
        out = self.model_copy(update={"sampling": resolve_sampling(env, self.sampling, given)})
        out._sampling_resolved = True
        return out

    def __eq__(self, other: object) -> bool:
        # Equal settings are equal configs, however they were given (a config file
        # written from one gives every field).
        if not isinstance(other, GRPOConfig):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    __hash__ = Group.__hash__

    @pydantic.field_validator("filters", mode="before")
    @classmethod
    def _load_filters(cls, value: Any) -> tuple[Any, ...]:
        items = [value] if isinstance(value, str) or callable(value) else list(value)
        return tuple(load_filter(f) if isinstance(f, str) else f for f in items)

    @pydantic.field_serializer("filters")
    def _filter_names(self, filters: tuple[Any, ...]) -> list[str]:
        return [filter_name(f) for f in filters]

    @pydantic.model_validator(mode="after")
    def _rules(self) -> Self:
        for i, f in enumerate(self.filters):
            if not callable(f):
                raise ConfigError(f"filters[{i}] ({f!r}) is not a group filter (not callable)")
        if self.schedule == "one_step_off" and self.max_staleness < 1:
            raise ConfigError(
                "--schedule one_step_off trains on samples one version old: --max-staleness "
                f"must be at least 1, got {self.max_staleness}"
            )
        if self.offload_rollout and self.schedule != "sync":
            raise ConfigError(
                f"--offload-rollout with --schedule {self.schedule}: episodes run while the "
                "trainer trains, so the engine cannot give its memory back; pass --schedule "
                "sync or drop --offload-rollout"
            )
        over = self.over_sampling_batch_size
        if over is not None and over < self.rollout_batch_size:
            raise ConfigError(
                f"--over-sampling-batch-size ({over}) must be at least --rollout-batch-size "
                f"({self.rollout_batch_size})"
            )
        left = self.rollout_batch_size * self.n_samples_per_prompt
        right = self.samples_per_step * self.num_steps_per_rollout
        if left != right:
            raise ConfigError(
                f"batch identity violated: rollout_batch_size ({self.rollout_batch_size}) "
                f"x n_samples_per_prompt ({self.n_samples_per_prompt}) = {left}, but "
                f"global_batch_size ({self.samples_per_step}) x num_steps_per_rollout "
                f"({self.num_steps_per_rollout}) = {right}; they must be equal"
            )
        self.buffer_config()  # checks the Buffer's own settings
        self.rollout_config(1)  # checks the template arguments
        return self

    @property
    def samples_per_step(self) -> int:
        return self.global_batch_size or self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def round_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size

    def concurrency_for(self, engine: _Engine) -> int:
        """Episodes in flight per round with ``engine``, and generate calls in flight over
        all rounds: :attr:`concurrency`, else what the engine decodes together
        (:attr:`RolloutEngine.capacity <trainer.RolloutEngine.capacity>`), else a whole
        round."""
        return self.concurrency or engine.capacity or self.round_size * self.n_samples_per_prompt

    def offloads(self, engine: _Engine) -> bool:
        """Whether ``engine`` releases its memory while each step trains:
        :attr:`offload_rollout`, by default on for an embedded engine on CPU on the
        ``sync`` schedule (nothing runs while the trainer trains, and a CPU engine has no
        decode graphs to capture again)."""
        return self.offloads_on(engine.device)

    def offloads_on(self, device: str | None) -> bool:
        """:meth:`offloads` for an embedded engine on ``device`` (``None``: not embedded)."""
        if self.offload_rollout is not None:
            return self.offload_rollout
        return self.schedule == "sync" and device == "cpu"

    def check_tasks(self, tasks: Sequence[Task]) -> None:
        """Refuse task lists with fewer distinct tasks than a round plays."""
        Task.check_all(tasks, "the training tasks")
        distinct = len({t.id for t in tasks})
        if distinct < self.round_size:
            raise ConfigError(
                f"{self.round_size} prompts per round (--rollout-batch-size or "
                f"--over-sampling-batch-size) but there are only {distinct} distinct tasks"
            )

    def rollout_config(self, concurrency: int) -> RolloutConfig:
        """What every round gives the rollout runner, from this group: the episodes of
        a prompt, their sampling, timeout and template arguments, ``concurrency``
        episodes in flight; each round sets its own seed and run id."""
        return RolloutConfig(
            n_samples_per_prompt=self.n_samples_per_prompt,
            sampling=self.sampling,
            concurrency=concurrency,
            seed=self.seed,
            chat_template_kwargs=self.chat_template_kwargs,
            limits=Limits(timeout_s=self.episode_timeout),
            progress=False,
        )

    def buffer_prompts(self) -> int:
        """The prompts whose groups the run's Buffer holds at most: the batches of the
        staleness bound, and a round beside them. The schedules never need more: async,
        admission control keeps the prompts alive (in flight or ready) within
        ``(max_staleness + 1) * rollout_batch_size`` (a round more while less than a batch
        is alive); sync and one_step_off play a round only while less than a batch is
        ready, and at most as many prompts as there is room for."""
        return (self.max_staleness + 1) * self.rollout_batch_size + self.round_size

    def buffer_config(self, groups_per_prompt: int = 1) -> BufferConfig:
        """The run's Buffer: its capacity :meth:`buffer_prompts` times the groups a prompt
        gives (``groups_per_prompt``: one per role of a game)."""
        from agentenv.buffer import BufferConfig  # numpy: only when it is checked

        return BufferConfig(
            n_samples_per_prompt=self.n_samples_per_prompt,
            rollout_batch_size=self.rollout_batch_size,
            filters=self.filters,
            max_staleness=self.max_staleness,
            capacity=groups_per_prompt * self.buffer_prompts(),
        )
