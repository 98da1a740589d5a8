"""Fixed players: scripted strategies (:class:`StrategyPlayer`, :class:`RandomPlayer`), a
frozen model in a seat (:class:`ModelPlayer`: prompted like a trained seat, its turns
make no samples), and :func:`play_match` for scripted players with no model."""

from __future__ import annotations

import abc
import dataclasses
import random
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from agentenv._errors import ConfigError
from agentenv._generator import Generator, SamplingParams
from agentenv._tokenizer import Tokenizer
from agentenv.games._game import Game, checked_legal_actions

__all__ = ["Match", "ModelPlayer", "Player", "RandomPlayer", "StrategyPlayer", "play_match"]


@runtime_checkable
class Player(Protocol):
    """A scripted player. ``act`` returns a legal move for ``role`` (whose turn it is),
    reading only what ``role`` may know and never changing ``game``; ``rng`` is its only
    source of randomness."""

    @property
    def name(self) -> str:
        """How statistics and errors name the player."""
        ...

    def act(self, game: Game, role: str, rng: random.Random) -> str:
        """The move to play."""
        ...


class StrategyPlayer(abc.ABC):
    """A player given by its mixed strategy: :meth:`strategy` maps moves to probabilities."""

    name: str = "strategy"

    @abc.abstractmethod
    def strategy(self, game: Game, role: str) -> dict[str, float]:
        """Probability of each move for ``role`` now (non-negative, summing to 1)."""

    def act(self, game: Game, role: str, rng: random.Random) -> str:
        probs = self.strategy(game, role)
        if not probs:
            raise ConfigError(f"{type(self).__name__} has no move for {role!r} in {game.name}")
        x = rng.random()
        acc = 0.0
        for action, p in probs.items():
            acc += p
            if x < acc:
                return action
        return next(reversed(probs))  # rounding left x >= the sum


class RandomPlayer(StrategyPlayer):
    """Plays a uniformly random legal move (the game must list its legal moves)."""

    name: str = "random"

    def strategy(self, game: Game, role: str) -> dict[str, float]:
        legal = checked_legal_actions(game)
        if legal is None:
            raise ConfigError(
                f"RandomPlayer needs legal moves, but {type(game).__name__}.legal_actions() "
                "returns None; implement legal_actions() or use another player"
            )
        return {a: 1.0 / len(legal) for a in legal}


@dataclasses.dataclass(slots=True)
class ModelPlayer:
    """A frozen model in a seat: prompted like a trained seat, its turns make no samples.

    Args:
        generator: the model (an SGLang client, an :class:`~agentenv.engine.Engine`, a
            :class:`~agentenv.ScriptedModel`, ...).
        tokenizer: renders its prompts (default: the trained policy's tokenizer).
        sampling: its sampling parameters (default: the run's).
        name: how statistics and errors name it.
    """

    generator: Generator
    tokenizer: Tokenizer | None = None
    sampling: SamplingParams | None = None
    name: str = "model"


@dataclasses.dataclass(frozen=True, slots=True)
class Match:
    """A match between scripted players: each role's return, the moves played in order,
    and whether ``max_moves`` cut it short (then ``returns`` is empty)."""

    returns: dict[str, float]
    moves: tuple[tuple[str, str], ...]
    truncated: bool = False


def play_match(
    game: Game,
    players: Mapping[str, Player],
    seed: int,
    *,
    max_moves: int = 1000,
) -> Match:
    """Reset ``game`` with ``seed`` and play it out with one scripted player per role.

    The players share one ``random.Random`` derived from ``seed`` (apart from the game's).
    """
    missing = [r for r in game.roles if r not in players]
    if missing:
        raise ConfigError(f"play_match needs a player for every role; missing {missing}")
    game.reset(seed)
    rng = random.Random(f"players:{seed}")
    moves: list[tuple[str, str]] = []
    while (role := game.current_role()) is not None:
        if len(moves) >= max_moves:
            return Match({}, tuple(moves), truncated=True)
        action = players[role].act(game, role, rng)
        game.play(role, action)
        moves.append((role, action))
    return Match(game.returns(), tuple(moves))
