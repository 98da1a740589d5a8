"""Any OpenSpiel game as an agentenv :class:`~agentenv.Game` (``pip install open_spiel``).

:class:`OpenSpielGame` wraps a sequential OpenSpiel game: roles ``player_0``,
``player_1``, ...; chance nodes are resolved by the adapter with the game's own seeded
RNG, with OpenSpiel's outcome probabilities; a role sees its information state (its
observation string for games without one) and the legal moves as OpenSpiel names them;
a move is one of those names or the action's number, in brackets. :class:`OpenSpielEnv`
makes it an environment: ``agentenv eval --env openspiel --env-args '{"game":
"kuhn_poker"}' --opponent random``.
"""

from __future__ import annotations

import importlib
import random
from typing import Any, Self

from agentenv import ConfigError, Game, GameEnv, IllegalMoveError, Message
from environments.games._prompt import prompt


def _pyspiel() -> Any:
    try:
        return importlib.import_module("pyspiel")
    except ImportError:
        raise ConfigError(
            "OpenSpiel games need the open_spiel package: pip install open_spiel"
        ) from None


class OpenSpielGame(Game):
    """An OpenSpiel game.

    Args:
        game: a game name (``"tic_tac_toe"``) or a loaded ``pyspiel.Game``.
        params: the game's parameters (``{"players": 3}``), with a name.
    """

    def __init__(
        self, game: str | Any = "tic_tac_toe", params: dict[str, Any] | None = None
    ) -> None:
        pyspiel = _pyspiel()
        self.game = pyspiel.load_game(game, params or {}) if isinstance(game, str) else game
        kind = self.game.get_type()
        if kind.dynamics != pyspiel.GameType.Dynamics.SEQUENTIAL:
            raise ConfigError(
                f"OpenSpielGame plays sequential games only; {kind.short_name!r} has "
                f"{kind.dynamics} dynamics"
            )
        self.name = kind.short_name
        self.long_name: str = kind.long_name
        self.roles = tuple(f"player_{i}" for i in range(self.game.num_players()))
        self._info_state = bool(kind.provides_information_state_string)
        self.state: Any = self.game.new_initial_state()
        self.rng = random.Random(0)

    def reset(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.state = self.game.new_initial_state()
        self._resolve_chance()

    def _resolve_chance(self) -> None:
        while self.state.is_chance_node():
            outcomes, probs = zip(*self.state.chance_outcomes(), strict=True)
            self.state.apply_action(self.rng.choices(outcomes, weights=probs)[0])

    def current_role(self) -> str | None:
        if self.state.is_terminal():
            return None
        return self.roles[int(self.state.current_player())]

    def _names(self) -> dict[str, int]:
        # Case-sensitive: in chess "bxa6" (a pawn) and "Bxa6" (a bishop) are two moves.
        player = self.state.current_player()
        return {
            self.state.action_to_string(player, a).strip(): a for a in self.state.legal_actions()
        }

    def legal_actions(self) -> list[str] | None:
        return [] if self.state.is_terminal() else list(self._names())

    def normalize(self, text: str) -> str:
        """The legal move named ``text``: exactly, else by a case-insensitive match when
        only one move matches, else by its action number."""
        move = " ".join(text.split())
        if self.state.is_terminal():
            return move
        names = self._names()
        if move in names:
            return move
        folded = [name for name in names if name.lower() == move.lower()]
        if len(folded) == 1:
            return folded[0]
        if move.isdigit():
            by_number = {a: name for name, a in names.items()}
            return by_number.get(int(move), move)
        return move

    def apply(self, action: str) -> None:
        names = self._names()
        if action not in names:
            raise IllegalMoveError(f"{action!r} is not a legal move; legal: {list(names)}")
        self.state.apply_action(names[action])
        self._resolve_chance()

    def returns(self) -> dict[str, float]:
        return {r: float(v) for r, v in zip(self.roles, self.state.returns(), strict=True)}

    def observation(self, role: str) -> list[Message]:
        player = self.roles.index(role)
        if self._info_state:
            seen = self.state.information_state_string(player)
        else:
            seen = self.state.observation_string(player)
        rules = (
            f"You are playing {self.long_name} as {role}. Think briefly, then end your reply "
            "with your move in square brackets, written as it appears in the list of legal moves."
        )
        legal = self.legal_actions() if self.current_role() == role else []
        return prompt(rules, f"What you see:\n{seen}", legal or [])

    def clone(self) -> Self:
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.state = self.state.clone()
        twin.rng = random.Random()
        twin.rng.setstate(self.rng.getstate())
        return twin


class OpenSpielEnv(GameEnv):
    """An OpenSpiel game as an environment (see :class:`GameEnv` for the options).

    Args:
        game: the OpenSpiel game name.
        params: its parameters.
    """

    name = "openspiel"

    def __init__(
        self, game: str = "tic_tac_toe", params: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self.spiel_game = _pyspiel().load_game(game, dict(params or {}))
        super().__init__(**kwargs)

    def new_game(self) -> Game:
        return OpenSpielGame(self.spiel_game)
