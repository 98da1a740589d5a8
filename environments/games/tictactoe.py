"""``tictactoe``: the 3x3 game, X moves first; cells are numbered 1-9 row by row.

Returns +1 for the winner, -1 for the loser, 0 for both on a draw. The same game as
OpenSpiel's ``tic_tac_toe`` (its action ``a`` is our cell ``a + 1``; player 0 is X),
which the tests check move by move. Opponents: ``random`` and ``optimal`` (minimax,
choosing uniformly among the best moves).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import ClassVar

from agentenv import Game, GameEnv, Message, Player, RandomPlayer, StrategyPlayer
from environments.games._prompt import prompt

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
RULES = (
    "You are playing Tic-Tac-Toe on a 3x3 board. Players take turns marking an empty "
    "cell; the first to get three of their marks in a row, column or diagonal wins, and a "
    "full board with no line is a draw. Cells are numbered 1 to 9, row by row. Think "
    "briefly, then end your reply with the number of the cell you mark in square "
    "brackets, e.g. [5]."
)


def winner(board: str) -> str | None:
    """``"x"`` or ``"o"`` if that mark has a line on ``board`` (9 chars of ``x``, ``o``,
    ``.``), else ``None``."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


class TicTacToe(Game):
    """Tic-Tac-Toe. State: the board as 9 characters and the moves so far."""

    name = "tictactoe"
    roles = ("x", "o")
    move_hint = "[5]"

    def __init__(self) -> None:
        self.board = "." * 9
        self.history: list[int] = []

    def reset(self, seed: int) -> None:  # the game has no chance: the seed changes nothing
        self.board = "." * 9
        self.history = []

    def current_role(self) -> str | None:
        if winner(self.board) or "." not in self.board:
            return None
        return "x" if len(self.history) % 2 == 0 else "o"

    def legal_actions(self) -> list[str] | None:
        if self.current_role() is None:
            return []
        return [str(i + 1) for i, c in enumerate(self.board) if c == "."]

    def apply(self, action: str) -> None:
        cell = int(action) - 1
        mark = self.current_role()
        assert mark is not None and self.board[cell] == "."
        self.board = self.board[:cell] + mark + self.board[cell + 1 :]
        self.history.append(cell + 1)

    def returns(self) -> dict[str, float]:
        w = winner(self.board)
        if w is None:
            return {"x": 0.0, "o": 0.0}
        return {w: 1.0, ("o" if w == "x" else "x"): -1.0}

    def render(self) -> str:
        """The board with marks in upper case and free cells shown by their number."""
        cells = [c.upper() if c != "." else str(i + 1) for i, c in enumerate(self.board)]
        return "\n".join(" | ".join(cells[r * 3 : r * 3 + 3]) for r in range(3))

    def observation(self, role: str) -> list[Message]:
        moves = ", ".join(
            f"{'X' if i % 2 == 0 else 'O'}:{cell}" for i, cell in enumerate(self.history)
        )
        situation = f"You play {role.upper()}. Moves so far: {moves or 'none'}.\n"
        return prompt(RULES, f"{situation}Board:\n{self.render()}", self.legal_actions() or [])


@functools.cache
def minimax(board: str) -> tuple[float, tuple[int, ...]]:
    """The value of ``board`` for the player to move (+1 win, 0 draw, -1 loss with best
    play on both sides) and the cells (1-9) that achieve it."""
    if winner(board):
        return -1.0, ()  # the previous mover made the line
    free = [i for i, c in enumerate(board) if c == "."]
    if not free:
        return 0.0, ()
    mark = "x" if board.count("x") == board.count("o") else "o"
    values = {i + 1: -minimax(board[:i] + mark + board[i + 1 :])[0] for i in free}
    best = max(values.values())
    return best, tuple(c for c, v in values.items() if v == best)


class MinimaxPlayer(StrategyPlayer):
    """Perfect play: uniformly among the moves with the best minimax value."""

    name = "optimal"

    def strategy(self, game: Game, role: str) -> dict[str, float]:
        assert isinstance(game, TicTacToe)
        _, best = minimax(game.board)
        return {str(c): 1.0 / len(best) for c in best}


class TicTacToeEnv(GameEnv):
    """Tic-Tac-Toe by self-play or against ``random``/``optimal`` (see :class:`GameEnv`)."""

    name = "tictactoe"
    players: ClassVar[Mapping[str, Callable[[], Player]]] = {
        "random": RandomPlayer,
        "optimal": MinimaxPlayer,
    }

    def new_game(self) -> Game:
        return TicTacToe()
