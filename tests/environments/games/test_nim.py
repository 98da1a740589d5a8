"""Nim against OpenSpiel's ``nim`` in both conventions, and the nim-sum player against a
brute-force solution."""

from __future__ import annotations

import functools
import itertools
import random
import re

import pyspiel  # a dev dependency: the differential tests must run, never skip
import pytest

from agentenv import ConfigError, InvalidMove, RandomPlayer, play_match
from environments.games.nim import ROLES, Nim, NimEnv, NimSumPlayer, winning_moves


def _ours(action: str) -> str:
    pile, take = re.findall(r"\d+", action)  # OpenSpiel writes "pile:2, take:3;"
    return f"{pile} {take}"


@pytest.mark.parametrize("misere", [False, True])
def test_random_games_agree_with_openspiel(misere: bool) -> None:
    spiel = pyspiel.load_game("nim", {"pile_sizes": "1;3;5;7", "is_misere": misere})
    rng = random.Random(int(misere))
    for g in range(300):
        ours, theirs = Nim(misere=misere), spiel.new_initial_state()
        ours.reset(g)
        while not theirs.is_terminal():
            player = theirs.current_player()
            assert ours.current_role() == ROLES[player]
            names = {_ours(theirs.action_to_string(player, a)): a for a in theirs.legal_actions()}
            assert sorted(ours.legal_actions() or []) == sorted(names)
            move = rng.choice(sorted(names))
            ours.play(ROLES[player], move)
            theirs.apply_action(names[move])
        assert ours.is_over()
        assert [ours.returns()[r] for r in ROLES] == theirs.returns()


@functools.cache
def _wins(heaps: tuple[int, ...], misere: bool) -> bool:
    """Brute force: does the player to move win?"""
    if not any(heaps):
        return misere  # the previous player took the last object
    for i, h in enumerate(heaps):
        for n in range(1, h + 1):
            after = (*heaps[:i], h - n, *heaps[i + 1 :])
            if not _wins(after, misere):
                return True
    return False


@pytest.mark.parametrize("misere", [False, True])
def test_nim_sum_moves_are_exactly_the_winning_ones(misere: bool) -> None:
    for heaps in itertools.product(range(2), range(4), range(6), range(8)):
        if not any(heaps):
            continue
        moves = winning_moves(heaps, misere)
        assert bool(moves) == _wins(heaps, misere), heaps
        for move in moves:
            i, n = (int(x) for x in move.split())
            after = (*heaps[: i - 1], heaps[i - 1] - n, *heaps[i:])
            assert not _wins(after, misere), (heaps, move)


@pytest.mark.parametrize("misere", [False, True])
def test_optimal_player_wins_every_winning_position(misere: bool) -> None:
    game, best, rand = Nim(misere=misere), NimSumPlayer(), RandomPlayer()
    # (1, 3, 5, 7) has nim-sum 0: the first player loses against perfect play
    for seed in range(60):
        assert play_match(game, {ROLES[0]: rand, ROLES[1]: best}, seed).returns[ROLES[1]] == 1.0
    three = Nim((2, 3, 4), misere=misere)  # nim-sum 5: the first player wins
    for seed in range(60):
        assert play_match(three, {ROLES[0]: best, ROLES[1]: rand}, seed).returns[ROLES[0]] == 1.0


def test_parsing_and_observation() -> None:
    game = Nim()
    game.reset(0)
    assert game.parse("I take three from the second heap: [2 3]") == "2 3"
    assert game.parse("[heap 4, take 7]") == "4 7"
    bad = game.parse("[1 2]")
    assert isinstance(bad, InvalidMove) and bad.reason.startswith("[1 2] is not a legal move")
    game.play(ROLES[0], "4 7")
    user = game.observation(ROLES[1])[1]["content"]
    assert (
        user
        == "You are player_1. Heaps now: heap 1: 1, heap 2: 3, heap 3: 5, heap 4: 0. Your move?"
    )
    assert "takes the last object wins" in game.observation(ROLES[1])[0]["content"]
    assert "loses" in Nim(misere=True).observation(ROLES[0])[0]["content"]
    with pytest.raises(
        ConfigError, match=r"heaps must be non-negative ints, not all zero, got \[0, 0\]"
    ):
        Nim((0, 0))
    env = NimEnv(heaps=(3, 4), misere=True, opponent="optimal")
    assert env.opponent_name == "optimal" and env.new_game().start == (3, 4)
