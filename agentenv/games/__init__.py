"""Multi-agent games: plug in the rules, train by self-play or against fixed opponents.

A :class:`Game` is the rules as plain synchronous code (roles, reset with a seed, whose
turn, a role-private observation, parsing and applying moves, returns). :class:`GameEnv`
plays it as an :class:`~agentenv.Environment`: one sample per turn of every trained seat,
fixed opponents (:class:`RandomPlayer` and other scripted players, a frozen model in a
:class:`ModelPlayer`), invalid-move retries or forfeits, discounting, and an optional
:class:`RoleBaseline`. :class:`GameTally` turns the samples into win/draw/loss rates per
seat with confidence intervals (``agentenv eval --opponent``); :func:`game_metrics` gives
the per-role figures each training step logs.
"""

from agentenv.games._baseline import RoleBaseline
from agentenv.games._env import GameEnv, Opponent
from agentenv.games._game import Game, InvalidMove, last_bracketed
from agentenv.games._players import (
    Match,
    ModelPlayer,
    Player,
    RandomPlayer,
    StrategyPlayer,
    play_match,
)
from agentenv.games._stats import GameTally, SeatStats, TallySink, game_metrics, wilson_interval

__all__ = [
    "Game",
    "GameEnv",
    "GameTally",
    "InvalidMove",
    "Match",
    "ModelPlayer",
    "Opponent",
    "Player",
    "RandomPlayer",
    "RoleBaseline",
    "SeatStats",
    "StrategyPlayer",
    "TallySink",
    "game_metrics",
    "last_bracketed",
    "play_match",
    "wilson_interval",
]
