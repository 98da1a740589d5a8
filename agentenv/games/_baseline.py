"""A role-conditioned baseline (SPIRAL's): an exponential moving average of returns per game
and role, ``b[g, r] <- decay * b[g, r] + (1 - decay) * G``, trained on as ``G - b[g, r]``.
The seats of a game are not alike, so one baseline for all would push the weaker seat's
every move down; a GRPO group per task and role already gives a per-role baseline, so
this is for trainers that pool roles (docs/games.md, "Per-role baselines")."""

from __future__ import annotations

import math

from agentenv._errors import ConfigError

__all__ = ["RoleBaseline"]


class RoleBaseline:
    """Exponential moving averages of returns, one per (game, role).

    Args:
        decay: weight of the old average in each update, in ``[0, 1)``.
        initial: the baseline before any return was seen.
    """

    def __init__(self, decay: float = 0.95, initial: float = 0.0) -> None:
        if not (0.0 <= decay < 1.0):
            raise ConfigError(f"decay must be in [0, 1), got {decay}")
        if not math.isfinite(initial):
            raise ConfigError(f"initial must be finite, got {initial}")
        self.decay = decay
        self.initial = initial
        self._values: dict[tuple[str, str], float] = {}

    def value(self, game: str, role: str) -> float:
        """The current baseline of ``role`` in ``game``."""
        return self._values.get((game, role), self.initial)

    def update(self, game: str, role: str, ret: float) -> float:
        """Fold ``ret`` into the average; returns the baseline *before* the update (the
        one to subtract from ``ret``, which it must not have seen)."""
        if not math.isfinite(ret):
            raise ConfigError(f"return must be finite, got {ret} for {role!r} in {game!r}")
        old = self.value(game, role)
        self._values[(game, role)] = self.decay * old + (1.0 - self.decay) * ret
        return old

    def values(self) -> dict[str, float]:
        """Every baseline, keyed ``"game/role"`` (for logging)."""
        return {f"{g}/{r}": v for (g, r), v in sorted(self._values.items())}

    def __repr__(self) -> str:
        return f"RoleBaseline(decay={self.decay}, values={self.values()})"
