"""The Buffer's settings and the group-level filters."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

from agentenv._errors import ConfigError
from agentenv._sample import Sample

__all__ = ["BufferConfig", "FilterResult", "GroupFilter", "RewardStdFilter"]


@dataclasses.dataclass(frozen=True, slots=True)
class FilterResult:
    """A filter's verdict on a group; ``reason`` is counted when it drops one."""

    keep: bool
    reason: str = ""


GroupFilter = Callable[[Sequence[Sample]], "FilterResult | bool | Awaitable[FilterResult | bool]"]
"""A group filter: the group's samples in, keep/drop (with a reason) out; sync or async."""


@dataclasses.dataclass(frozen=True, slots=True)
class RewardStdFilter:
    """Drop groups whose rewards are all equal: no GRPO signal (DAPO's dynamic sampling)."""

    min_std: float = 1e-6

    @property
    def __name__(self) -> str:  # used as the default drop reason
        return "zero_reward_std"

    def __call__(self, samples: Sequence[Sample]) -> FilterResult:
        rewards = [s.reward for s in samples]
        mean = math.fsum(rewards) / len(rewards)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
        return FilterResult(std > self.min_std, "zero_reward_std")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BufferConfig:
    """How the Buffer assembles, filters, bounds and hands out groups.

    Args:
        n_samples_per_prompt: episodes per group (the GRPO group size).
        min_group_size: with ``on_failed="drop_samples"``, the fewest surviving episodes
            for which a group is kept.
        on_failed: ``"drop_samples"`` removes failed samples and keeps the group if at
            least ``min_group_size`` episodes remain; ``"drop_group"`` drops any group with
            a failed sample.
        filters: group filters, applied in order to complete groups (e.g.
            ``RewardStdFilter()``).
        capacity: ready groups held at most; ``put_group`` waits while the Buffer is full.
        max_staleness: a batch for policy version ``v`` holds no group produced by a
            version older than ``v - max_staleness`` (``None``: unbounded). Versions are
            the integers in the samples' ``weight_versions``.
        on_stale: what to do with a stale group: ``"drop"`` it, or ``"recycle"`` its task
            (``Buffer.recycled()`` lists tasks to play again).
        rollout_batch_size: groups per batch (the default for ``get_batch``).
        durability: for a durable Buffer, ``"power"`` (a put is fsynced to disk before
            it returns; survives power loss) or ``"process"`` (survives a killed process,
            not a power cut or kernel crash; about 1.5x faster).

    How a trainer splits a batch into optimizer steps is the trainer's (its batch
    identity is checked in :class:`trainer.GRPOConfig`), not the Buffer's.
    """

    n_samples_per_prompt: int = 1
    min_group_size: int = 1
    on_failed: Literal["drop_samples", "drop_group"] = "drop_samples"
    filters: Sequence[GroupFilter] = ()
    capacity: int = 1024
    max_staleness: int | None = None
    on_stale: Literal["drop", "recycle"] = "drop"
    rollout_batch_size: int | None = None
    durability: Literal["power", "process"] = "power"

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1:
            raise ConfigError(
                f"n_samples_per_prompt must be at least 1, got {self.n_samples_per_prompt}"
            )
        if not 1 <= self.min_group_size <= self.n_samples_per_prompt:
            raise ConfigError(
                f"min_group_size must be in [1, n_samples_per_prompt "
                f"({self.n_samples_per_prompt})], got {self.min_group_size}"
            )
        for name, allowed in (
            ("on_failed", ("drop_samples", "drop_group")),
            ("durability", ("power", "process")),
            ("on_stale", ("drop", "recycle")),
        ):
            if (value := getattr(self, name)) not in allowed:
                raise ConfigError(f"{name} must be {allowed[0]!r} or {allowed[1]!r}, got {value!r}")
        if self.capacity < 1:
            raise ConfigError(f"capacity must be at least 1 group, got {self.capacity}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be at least 0, got {self.max_staleness}")
        if self.rollout_batch_size is not None and self.rollout_batch_size < 1:
            raise ConfigError(
                f"rollout_batch_size must be at least 1, got {self.rollout_batch_size}"
            )
        for f in self.filters:
            if not callable(f):
                raise ConfigError(f"a group filter must be callable, got {type(f).__name__}")
        if self.capacity < (self.rollout_batch_size or 1):
            raise ConfigError(
                f"capacity ({self.capacity}) must hold at least one batch "
                f"(rollout_batch_size {self.rollout_batch_size})"
            )
