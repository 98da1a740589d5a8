"""The game protocol without a model: parsing, checked moves, players, baselines, intervals."""

from __future__ import annotations

import math
import random

import pytest

from agentenv import (
    ConfigError,
    Game,
    IllegalMoveError,
    InvalidMove,
    Message,
    RandomPlayer,
    RoleBaseline,
    StrategyPlayer,
    play_match,
)
from agentenv.games import last_bracketed, wilson_interval


class Countdown(Game):
    """Two players take 1 or 2 from a pile of ``start``; whoever takes the last one wins."""

    name = "countdown"
    roles = ("a", "b")
    move_hint = "[1]"

    def __init__(self, start: int = 5) -> None:
        self.start = start
        self.pile = start
        self.moves = 0

    def reset(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pile, self.moves = self.start, 0

    def current_role(self) -> str | None:
        return None if self.pile == 0 else self.roles[self.moves % 2]

    def legal_actions(self) -> list[str] | None:
        return [str(n) for n in (1, 2) if n <= self.pile]

    def apply(self, action: str) -> None:
        self.pile -= int(action)
        self.moves += 1

    def returns(self) -> dict[str, float]:
        last = self.roles[(self.moves - 1) % 2]
        return {r: 1.0 if r == last else -1.0 for r in self.roles}

    def observation(self, role: str) -> list[Message]:
        return [{"role": "user", "content": f"{role}: pile {self.pile}"}]


def test_last_bracketed_takes_the_last_move() -> None:
    assert last_bracketed("maybe [3]... no, [5]") == "5"
    assert last_bracketed("  [ bet ] ") == "bet"
    assert last_bracketed("no brackets") is None
    assert last_bracketed("[]") is None
    assert last_bracketed("[a\nb]") is None  # one line only


def test_parse_names_the_problem_and_the_fix() -> None:
    game = Countdown()
    game.reset(0)
    assert game.parse("I take [2]") == "2"
    none = game.parse("I take two")
    assert isinstance(none, InvalidMove) and none.text is None
    assert "no move found" in none.reason and "[1]" in none.reason
    bad = game.parse("[7]")
    assert isinstance(bad, InvalidMove) and bad.text == "7"
    assert bad.reason == "[7] is not a legal move now; legal moves: [1], [2]."


def test_play_checks_turn_legality_and_the_end() -> None:
    game = Countdown(start=2)
    game.reset(0)
    with pytest.raises(IllegalMoveError, match="'b' played '1' out of turn: it is the turn of 'a'"):
        game.play("b", "1")
    with pytest.raises(IllegalMoveError, match=r"'3' is not a legal move for 'a' now; legal: \["):
        game.play("a", "3")
    with pytest.raises(IllegalMoveError, match="unknown role 'c'"):
        game.play("c", "1")
    assert game.pile == 2 and game.moves == 0  # nothing changed
    game.play("a", "2")
    assert game.is_over() and game.returns() == {"a": 1.0, "b": -1.0}
    with pytest.raises(IllegalMoveError, match="match is over"):
        game.play("b", "1")


def test_clone_is_independent() -> None:
    game = Countdown()
    game.reset(0)
    twin = game.clone()
    twin.play("a", "1")
    assert game.pile == 5 and twin.pile == 4


def test_play_match_is_reproducible_and_checks_players() -> None:
    game, r = Countdown(start=9), RandomPlayer()
    first = play_match(game, {"a": r, "b": r}, seed=3)
    assert play_match(game, {"a": r, "b": r}, seed=3) == first
    assert sum(int(a) for _, a in first.moves) == 9
    assert [role for role, _ in first.moves][:2] == ["a", "b"]
    with pytest.raises(ConfigError, match=r"missing \['b'\]"):
        play_match(game, {"a": r}, seed=0)
    capped = play_match(game, {"a": r, "b": r}, seed=3, max_moves=2)
    assert capped.truncated and capped.returns == {} and len(capped.moves) == 2


def test_strategy_player_samples_its_strategy() -> None:
    class TwoThirds(StrategyPlayer):
        def strategy(self, game: Game, role: str) -> dict[str, float]:
            return {"1": 2 / 3, "2": 1 / 3}

    game = Countdown()
    game.reset(0)
    rng = random.Random(0)
    picks = [TwoThirds().act(game, "a", rng) for _ in range(3000)]
    assert abs(picks.count("1") / 3000 - 2 / 3) < 0.03


def test_random_player_needs_legal_moves() -> None:
    class Unlisted(Countdown):
        def legal_actions(self) -> list[str] | None:
            return None

    game = Unlisted()
    game.reset(0)
    with pytest.raises(ConfigError, match=r"RandomPlayer needs legal moves.*Unlisted"):
        RandomPlayer().act(game, "a", random.Random(0))


def test_role_baseline_is_an_ema_per_game_and_role() -> None:
    b = RoleBaseline(decay=0.5)
    assert b.update("g", "x", 1.0) == 0.0  # the baseline before the update
    assert b.update("g", "x", 1.0) == 0.5
    assert b.value("g", "x") == 0.75
    assert b.value("g", "o") == 0.0 and b.value("h", "x") == 0.0
    assert b.values() == {"g/x": 0.75}
    with pytest.raises(ConfigError, match=r"decay must be in \[0, 1\), got 1.0"):
        RoleBaseline(decay=1.0)
    with pytest.raises(ConfigError, match="return must be finite"):
        b.update("g", "x", math.nan)


def test_wilson_interval() -> None:
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and 0.1 < hi < 0.2


class IntMoves(Countdown):
    """Lists its moves as ints: every move would be rejected, the listed ones included."""

    def legal_actions(self) -> list[str] | None:
        return [1, 2]  # type: ignore[list-item]


def test_moves_that_are_not_strings_are_refused_naming_the_fix() -> None:
    game = IntMoves()
    game.reset(0)
    fix = r"legal_actions\(\) must return moves as strings, got int 1 in \[1, 2\]; return"
    with pytest.raises(ConfigError, match=fix):
        game.parse("[1]")
    with pytest.raises(ConfigError, match=fix):
        game.play("a", "1")
    with pytest.raises(ConfigError, match=fix):
        RandomPlayer().act(game, "a", random.Random(0))
