"""The game protocol: the rules of a turn-based game as plain synchronous code, no model.

A :class:`Game` object holds one match: its roles, whose turn it is, what each role may
see (as chat messages), the legal moves and the returns. Moves are strings (``"5"``,
``"bet"``, ``"2 3"``); players write theirs in square brackets, and the last ``[...]`` of a
completion is the move, so a model may reason before it (docs/games.md)."""

from __future__ import annotations

import abc
import copy
import dataclasses
import re
from typing import ClassVar, Self

from agentenv._errors import ConfigError, IllegalMoveError
from agentenv._messages import Message

__all__ = ["Game", "InvalidMove", "checked_legal_actions", "last_bracketed"]

_BRACKETED = re.compile(r"\[([^\[\]\n]{1,64})\]")


def last_bracketed(text: str) -> str | None:
    """The stripped text inside the last ``[...]`` of ``text`` (one line, at most 64
    characters), or ``None`` when there is none."""
    found = _BRACKETED.findall(text)
    return found[-1].strip() if found else None


def checked_legal_actions(game: Game) -> list[str] | None:
    """``game.legal_actions()``, refused unless it is ``None`` or a list of strings.

    Moves are compared as text (a player writes ``[5]``, which parses to ``"5"``), so a
    game listing ``[1, 2]`` would reject every move, ``1`` included.
    """
    legal = game.legal_actions()
    if legal is None:
        return None
    if isinstance(legal, str) or not isinstance(legal, list | tuple):
        raise ConfigError(
            f"{type(game).__name__}.legal_actions() must return a list of strings or None, "
            f"got {type(legal).__name__} {legal!r}"
        )
    bad = [a for a in legal if not isinstance(a, str)]
    if bad:
        raise ConfigError(
            f"{type(game).__name__}.legal_actions() must return moves as strings, got "
            f"{type(bad[0]).__name__} {bad[0]!r} in {list(legal)!r}; return their text, "
            "e.g. [str(m) for m in moves], and take a string in apply()"
        )
    return list(legal)


@dataclasses.dataclass(frozen=True, slots=True)
class InvalidMove:
    """What :meth:`Game.parse` returns for a completion that is not a legal move now.

    Args:
        reason: what was wrong and how to write a legal move; shown to the player when
            it may retry.
        text: the move as the player wrote it, when one was found.
    """

    reason: str
    text: str | None = None


class Game(abc.ABC):
    """The rules of a turn-based game for one or more roles; one object is one match.

    Implement :meth:`reset`, :meth:`current_role`, :meth:`observation`, :meth:`apply` and
    :meth:`returns`, and usually :meth:`legal_actions` (random and scripted players need
    it; :meth:`parse` then rejects illegal moves itself). Chance (a deal, a dice roll)
    comes from the game's own ``random.Random(seed)`` made in :meth:`reset`, never from
    the global ``random`` module, so a match is reproducible from its seed.

    Class attributes (``name`` and ``roles`` may also be set per instance, as adapters do):
        name: a short name (``"tictactoe"``); it keys per-game statistics and baselines.
        roles: the seats, in order (``("x", "o")``).
        move_hint: an example of a well-formed move, shown when a reply has none.
    """

    name: str = ""
    roles: tuple[str, ...] = ()
    move_hint: ClassVar[str] = "[move]"

    @abc.abstractmethod
    def reset(self, seed: int) -> None:
        """Start a new match; all of its chance comes from ``random.Random(seed)``."""

    @abc.abstractmethod
    def current_role(self) -> str | None:
        """The role to move now, or ``None`` once the match is over."""

    @abc.abstractmethod
    def observation(self, role: str) -> list[Message]:
        """The chat messages ``role`` is prompted with now: the rules, its private
        information and the public history of moves -- never another role's private
        information."""

    def legal_actions(self) -> list[str] | None:
        """The moves the current role may play now (``None``: the game does not list them,
        and :meth:`apply` raises :class:`IllegalMoveError` for an illegal one)."""
        return None

    @abc.abstractmethod
    def apply(self, action: str) -> None:
        """Play ``action`` for the current role. :meth:`play` (which ``GameEnv`` and the
        players go through) calls it only with a move checked against
        :meth:`legal_actions`; a game that lists no legal actions must itself raise
        :class:`IllegalMoveError` for an illegal move and leave the state unchanged."""

    @abc.abstractmethod
    def returns(self) -> dict[str, float]:
        """Each role's return once the match is over (e.g. +1 win, -1 loss, 0 draw)."""

    # -- provided ------------------------------------------------------------------------
    def normalize(self, text: str) -> str:
        """The canonical move for what a player wrote in brackets (default: lower case,
        single spaces)."""
        return " ".join(text.lower().split())

    def parse(self, text: str) -> str | InvalidMove:
        """The move in a completion (its last ``[...]``), or an :class:`InvalidMove` saying
        what was wrong: no move found, or a move that is not legal now."""
        found = last_bracketed(text)
        if found is None:
            return InvalidMove(
                f"no move found: end your reply with your move in square brackets, "
                f"e.g. {self.move_hint}."
            )
        action = self.normalize(found)
        legal = checked_legal_actions(self)
        if legal is not None and action not in legal:
            return InvalidMove(
                f"[{found}] is not a legal move now; legal moves: "
                f"{', '.join(f'[{a}]' for a in legal)}.",
                text=found,
            )
        return action

    def play(self, role: str, action: str) -> None:
        """Play ``action`` for ``role``, checking first that the match is on, that it is
        ``role``'s turn and (when the game lists them) that the move is legal.

        Raises:
            IllegalMoveError: naming the role, the move and what is allowed instead.
        """
        current = self.current_role()
        if role not in self.roles:
            raise IllegalMoveError(f"unknown role {role!r}; {self.name} has roles {self.roles}")
        if current is None:
            raise IllegalMoveError(
                f"the {self.name} match is over; {role!r} cannot play {action!r}"
            )
        if role != current:
            raise IllegalMoveError(
                f"{role!r} played {action!r} out of turn: it is the turn of {current!r}"
            )
        legal = checked_legal_actions(self)
        if legal is not None and action not in legal:
            raise IllegalMoveError(
                f"{action!r} is not a legal move for {role!r} now; legal: {legal}"
            )
        self.apply(action)

    def truncated(self) -> bool:
        """Whether the match, now over, was cut short by the game's own limit rather than
        decided (default: never); ``GameEnv`` counts it as truncated, not as a draw."""
        return False

    def is_over(self) -> bool:
        """Whether the match has ended."""
        return self.current_role() is None

    def clone(self) -> Self:
        """An independent copy of the match (default: a deep copy), for search."""
        return copy.deepcopy(self)
