"""``nim``: heaps of objects; a move takes one or more objects from one heap.

The convention, pinned: **normal play** -- the player who takes the last object wins
(+1, the other -1). ``misere=True`` plays the misère convention instead (taking the last
object loses), which is OpenSpiel's default. Heaps default to (1, 3, 5, 7) as in
OpenSpiel's ``nim``; ``player_0`` moves first. A move is written ``[heap count]`` with
heaps numbered from 1: ``[2 3]`` takes 3 objects from heap 2.

The ``optimal`` opponent plays the nim-sum rule (with the misère correction when the
heaps are small), uniformly among winning moves, or uniformly when it has none.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from agentenv import ConfigError, Game, GameEnv, Message, Player, RandomPlayer, StrategyPlayer
from environments.games._prompt import prompt

ROLES = ("player_0", "player_1")


class Nim(Game):
    """Nim. State: ``heaps`` (objects per heap) and ``turn`` (moves played)."""

    name = "nim"
    roles = ROLES
    move_hint = "[2 3]"

    def __init__(self, heaps: Sequence[int] = (1, 3, 5, 7), *, misere: bool = False) -> None:
        if not heaps or any(type(h) is not int or h < 0 for h in heaps) or not any(heaps):
            raise ConfigError(f"heaps must be non-negative ints, not all zero, got {list(heaps)}")
        self.start = tuple(heaps)
        self.misere = misere
        self.heaps = list(heaps)
        self.turn = 0

    def reset(self, seed: int) -> None:  # Nim has no chance: the seed changes nothing
        self.heaps = list(self.start)
        self.turn = 0

    def current_role(self) -> str | None:
        return None if not any(self.heaps) else ROLES[self.turn % 2]

    def legal_actions(self) -> list[str] | None:
        return [f"{h + 1} {n}" for h, size in enumerate(self.heaps) for n in range(1, size + 1)]

    def normalize(self, text: str) -> str:
        return " ".join(re.findall(r"\d+", text))

    def apply(self, action: str) -> None:
        heap, count = (int(x) for x in action.split())
        self.heaps[heap - 1] -= count
        self.turn += 1

    def returns(self) -> dict[str, float]:
        last = ROLES[(self.turn - 1) % 2]  # took the last object
        other = ROLES[self.turn % 2]
        win, lose = (other, last) if self.misere else (last, other)
        return {win: 1.0, lose: -1.0}

    def observation(self, role: str) -> list[Message]:
        goal = "loses" if self.misere else "wins"
        heaps = ", ".join(f"heap {i + 1}: {n}" for i, n in enumerate(self.heaps))
        rules = (
            "You are playing Nim. There are heaps of objects; players take turns removing "
            f"one or more objects from a single heap. The player who takes the last object "
            f"{goal}. Think briefly, then end your reply with your move in square brackets "
            "as [heap count], e.g. [2 3] takes 3 objects from heap 2."
        )
        return prompt(rules, f"You are {role}. Heaps now: {heaps}.")


def winning_moves(heaps: Sequence[int], misere: bool) -> list[str]:
    """The moves (``"heap count"``) that leave the opponent a lost position."""
    big = sum(1 for h in heaps if h > 1)
    if misere and big <= 1:
        ones = sum(1 for h in heaps if h == 1)
        if big == 0:  # only ones: win by leaving an odd number of them
            return [f"{i + 1} 1" for i, h in enumerate(heaps) if h == 1] if ones % 2 == 0 else []
        i = next(i for i, h in enumerate(heaps) if h > 1)
        keep = 1 if ones % 2 == 0 else 0  # leave an odd number of single objects
        return [f"{i + 1} {heaps[i] - keep}"]
    x = 0
    for h in heaps:
        x ^= h
    if x == 0:
        return []
    return [f"{i + 1} {h - (h ^ x)}" for i, h in enumerate(heaps) if h ^ x < h]


class NimSumPlayer(StrategyPlayer):
    """Optimal Nim: uniformly among winning moves (nim-sum rule), else any legal move."""

    name = "optimal"

    def strategy(self, game: Game, role: str) -> dict[str, float]:
        assert isinstance(game, Nim)
        moves = winning_moves(game.heaps, game.misere) or game.legal_actions() or []
        return {m: 1.0 / len(moves) for m in moves}


class NimEnv(GameEnv):
    """Nim by self-play or against ``random``/``optimal`` (see :class:`GameEnv`).

    ``heaps`` and ``misere`` choose the variant (default: (1, 3, 5, 7), normal play).
    """

    name = "nim"
    players: ClassVar[Mapping[str, Callable[[], Player]]] = {
        "random": RandomPlayer,
        "optimal": NimSumPlayer,
    }

    def __init__(
        self, heaps: Sequence[int] = (1, 3, 5, 7), misere: bool = False, **kwargs: Any
    ) -> None:
        self.heaps = tuple(heaps)
        self.misere = misere
        super().__init__(**kwargs)

    def new_game(self) -> Game:
        return Nim(self.heaps, misere=self.misere)
