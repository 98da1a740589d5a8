"""Win/draw/loss statistics of game episodes, per seat, with confidence intervals.

:class:`GameTally` reads the samples a :class:`~agentenv.GameEnv` emits (a seat's last
sample in an episode carries ``metadata["final"]`` and its ``outcome``);
:class:`TallySink` counts them on their way into another sink (``agentenv eval``);
:func:`game_metrics` gives a training step's per-role figures. See docs/games.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from agentenv._runner import SampleSink
from agentenv._sample import Sample, Status

__all__ = ["GameTally", "SeatStats", "TallySink", "game_metrics", "wilson_interval"]

OUTCOMES = ("win", "draw", "loss", "truncated", "aborted")


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``k / n`` (95 % for ``z = 1.96``);
    ``(0.0, 1.0)`` when ``n == 0``."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclasses.dataclass(slots=True)
class SeatStats:
    """Counts for one seat (role) of the trained policy."""

    episodes: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    returns: float = 0.0
    attempts: int = 0
    invalid: int = 0
    forfeits: int = 0
    samples: int = 0
    rewards: float = 0.0

    def add(self, other: SeatStats) -> None:
        self.episodes += other.episodes
        for k, v in other.outcomes.items():
            self.outcomes[k] = self.outcomes.get(k, 0) + v
        self.returns += other.returns
        self.attempts += other.attempts
        self.invalid += other.invalid
        self.forfeits += other.forfeits
        self.samples += other.samples
        self.rewards += other.rewards

    def to_dict(self) -> dict[str, Any]:
        """Rates (``win_rate``, ``draw_rate``, ``loss_rate``, ``truncated_rate``,
        ``invalid_move_rate``), their 95 % Wilson intervals (``*_ci``), the mean return
        (the seat's score per episode), the mean reward of its samples (``reward_mean``:
        what the trainer sees, a baseline subtracted) and the counts."""
        n = self.episodes
        out: dict[str, Any] = {"episodes": n}
        for key in OUTCOMES:
            k = self.outcomes.get(key, 0)
            out[f"{key}_rate"] = k / n if n else 0.0
            out[f"{key}_rate_ci"] = list(wilson_interval(k, n))
        out["invalid_move_rate"] = self.invalid / self.attempts if self.attempts else 0.0
        out["invalid_move_rate_ci"] = list(wilson_interval(self.invalid, self.attempts))
        out["mean_return"] = self.returns / n if n else 0.0
        out["reward_mean"] = self.rewards / self.samples if self.samples else 0.0
        out["attempts"] = self.attempts
        out["invalid_moves"] = self.invalid
        out["forfeits"] = self.forfeits
        return out


class GameTally:
    """Per-seat outcome counts over game samples; failed episodes counted apart."""

    def __init__(self) -> None:
        self.seats: dict[str, SeatStats] = {}
        self._failed: set[tuple[str | None, int | None, str | None]] = set()

    @property
    def failed(self) -> int:
        """Failed episodes (each counted once, whatever its number of samples)."""
        return len(self._failed)

    def add(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            if s.status is Status.FAILED:
                self._failed.add((s.group_id, s.episode, s.id if s.episode is None else None))
                continue
            meta = s.metadata
            if "outcome" not in meta or s.role is None:
                continue
            seat = self.seats.setdefault(s.role, SeatStats())
            seat.samples += 1
            seat.rewards += s.reward
            if meta.get("segment", 0) == 0:  # a turn split in segments counts once
                seat.attempts += int(meta.get("attempts", 0))
                seat.invalid += int(meta.get("invalid", 0))
            if meta.get("final"):
                seat.episodes += 1
                outcome = str(meta["outcome"])
                seat.outcomes[outcome] = seat.outcomes.get(outcome, 0) + 1
                seat.returns += float(meta.get("return", 0.0))
                seat.forfeits += bool(meta.get("forfeit"))

    def summary(self) -> dict[str, Any]:
        """Rates over all seats at the top level (see :meth:`SeatStats.to_dict`), each
        seat's under ``seats``, and ``failed_episodes``. The top level counts seat-episodes:
        in self-play every match counts once per seat (its wins and losses mirror each
        other), so read the per-seat figures there; against an opponent it is per match."""
        total = SeatStats()
        for seat in self.seats.values():
            total.add(seat)
        out = total.to_dict()
        out["seats"] = {role: s.to_dict() for role, s in sorted(self.seats.items())}
        out["failed_episodes"] = self.failed
        return out


_STEP_RATES = ("win_rate", "draw_rate", "loss_rate", "invalid_move_rate")


def game_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """A training step's game figures as flat metrics (``game/win_rate``, ...,
    ``game/<role>/reward_mean``, ...: docs/games.md, "Self-play training"); empty when no
    sample is a game's, so other environments log no ``game/`` key."""
    tally = GameTally()
    tally.add(samples)
    if not tally.seats:
        return {}
    summary = tally.summary()
    out = {f"game/{key}": float(summary[key]) for key in _STEP_RATES}
    for role, seat in summary["seats"].items():
        for key in (*_STEP_RATES, "reward_mean", "mean_return"):
            out[f"game/{role}/{key}"] = float(seat[key])
    return out


class TallySink:
    """A sink that counts game outcomes and passes every group on to ``inner``."""

    def __init__(self, inner: SampleSink, tally: GameTally | None = None) -> None:
        self.inner = inner
        self.tally = tally or GameTally()

    async def put_group(self, samples: Sequence[Sample]) -> None:
        self.tally.add(samples)
        await self.inner.put_group(samples)
