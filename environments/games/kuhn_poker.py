"""``kuhn_poker``: one hand of Kuhn Poker, as OpenSpiel's ``kuhn_poker``.

The rules are :data:`RULES` (what the players read); the deal comes from the game's own
seeded RNG and ``[pass]`` is accepted for check and fold. Returns are chips won or lost:
±1 or ±2. Each player sees only its own card and the betting so far. Opponents:
``random`` and ``optimal`` (a Nash equilibrium; the first player's value is -1/18).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import ClassVar

from agentenv import ConfigError, Game, GameEnv, Message, Player, RandomPlayer, StrategyPlayer
from environments.games._prompt import prompt

CARDS = ("J", "Q", "K")
ROLES = ("player_0", "player_1")
TERMINAL = ("pp", "bp", "bb", "pbp", "pbb")  # OpenSpiel's histories: p = pass, b = bet
RULES = (
    "You are playing Kuhn Poker, one hand. The deck has three cards: J < Q < K. Each of "
    "the two players antes 1 chip and is dealt one card that the other cannot see. "
    "player_0 acts first. With no bet outstanding you may [check] or [bet] 1 chip; facing "
    "a bet you may [fold] (the bettor takes the pot) or [call] (match it). If nobody "
    "folds, the higher card takes the pot. Think briefly, then end your reply with your "
    "move in square brackets, e.g. [check]."
)


class KuhnPoker(Game):
    """Kuhn Poker. State: ``cards`` (card index 0-2 per player) and ``history`` (p/b)."""

    name = "kuhn_poker"
    roles = ROLES
    move_hint = "[check]"

    def __init__(self) -> None:
        self.cards: tuple[int, int] = (0, 1)
        self.history = ""

    def reset(self, seed: int) -> None:
        self.rng = random.Random(seed)
        first, second = self.rng.sample(range(3), 2)
        self.cards = (first, second)
        self.history = ""

    def current_role(self) -> str | None:
        if self.history in TERMINAL:
            return None
        return ROLES[len(self.history) % 2]

    def facing_bet(self) -> bool:
        return "b" in self.history

    def legal_actions(self) -> list[str] | None:
        if self.current_role() is None:
            return []
        return ["fold", "call"] if self.facing_bet() else ["check", "bet"]

    def normalize(self, text: str) -> str:
        move = text.strip().lower()
        if move == "pass":
            return "fold" if self.facing_bet() else "check"
        return move

    def apply(self, action: str) -> None:
        self.history += "p" if action in ("check", "fold") else "b"

    def returns(self) -> dict[str, float]:
        h = self.history
        if h == "bp":
            win = 1.0
        elif h == "pbp":
            win = -1.0
        else:
            stake = 2.0 if "b" in h else 1.0
            win = stake if self.cards[0] > self.cards[1] else -stake
        return {ROLES[0]: win, ROLES[1]: -win}

    def describe(self) -> str:
        """The betting so far, in words."""
        words = []
        bet = False
        for i, a in enumerate(self.history):
            if a == "b":
                word = "calls" if bet else "bets"
                bet = True
            else:
                word = "folds" if bet else "checks"
            words.append(f"{ROLES[i % 2]} {word}")
        return ", ".join(words) or "nothing yet"

    def observation(self, role: str) -> list[Message]:
        me = ROLES.index(role)
        situation = (
            f"You are {role} ({'first' if me == 0 else 'second'} to act). "
            f"Your card: {CARDS[self.cards[me]]}.\nBetting so far: {self.describe()}."
        )
        return prompt(RULES, situation, self.legal_actions() or [])


class NashPlayer(StrategyPlayer):
    """A Nash equilibrium of Kuhn Poker (Kuhn 1950), with the first player's bluffing
    parameter ``alpha`` in [0, 1/3]: player_0 bets J with ``alpha``, K with ``3 alpha``,
    calls a bet with Q with ``alpha + 1/3``; player_1 calls with Q 1/3 of the time and
    bluffs with J 1/3 of the time after a check."""

    name = "optimal"

    def __init__(self, alpha: float = 0.0) -> None:
        if not 0.0 <= alpha <= 1.0 / 3.0:
            raise ConfigError(f"alpha must be in [0, 1/3], got {alpha}")
        self.alpha = alpha

    def strategy(self, game: Game, role: str) -> dict[str, float]:
        assert isinstance(game, KuhnPoker)
        card = game.cards[ROLES.index(role)]
        a = self.alpha
        aggressive = {  # probability of bet/call per card, by betting so far
            "": (a, 0.0, 3 * a),
            "pb": (0.0, a + 1 / 3, 1.0),
            "b": (0.0, 1 / 3, 1.0),
            "p": (1 / 3, 0.0, 1.0),
        }[game.history][card]
        passive, active = game.legal_actions() or ["", ""]
        return {passive: 1.0 - aggressive, active: aggressive}


class KuhnPokerEnv(GameEnv):
    """Kuhn Poker by self-play or against ``random``/``optimal`` (see :class:`GameEnv`)."""

    name = "kuhn_poker"
    players: ClassVar[Mapping[str, Callable[[], Player]]] = {
        "random": RandomPlayer,
        "optimal": NashPlayer,
    }

    def new_game(self) -> Game:
        return KuhnPoker()
