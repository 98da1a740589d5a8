"""TicTacToe against OpenSpiel's ``tic_tac_toe``: move by move, exact random-play outcome
probabilities, the statistics of random play through GameEnv, and the minimax player."""

from __future__ import annotations

import functools
import random
import re
from typing import Any

import anyio
import pyspiel  # a dev dependency: the differential tests must run, never skip
import pytest

from agentenv import ChatTokenizer, RandomPlayer, RolloutConfig, ScriptedModel, play_match
from agentenv._scripted import ScriptContext
from agentenv.games import TallySink
from environments.games.tictactoe import MinimaxPlayer, TicTacToe, TicTacToeEnv, minimax

ROLES = ("x", "o")
# P(X wins), P(O wins), P(draw) when both play uniformly at random: 58.5 %, 28.8 %, 12.7 %.
RANDOM_PLAY = (737 / 1260, 363 / 1260, 160 / 1260)


def test_random_games_agree_with_openspiel_at_every_step() -> None:
    spiel = pyspiel.load_game("tic_tac_toe")
    rng = random.Random(0)
    for g in range(400):
        ours, theirs = TicTacToe(), spiel.new_initial_state()
        ours.reset(g)
        while not theirs.is_terminal():
            assert not ours.is_over()
            assert ours.current_role() == ROLES[theirs.current_player()]
            assert [int(a) - 1 for a in ours.legal_actions() or []] == theirs.legal_actions()
            action = rng.choice(theirs.legal_actions())
            ours.play(ROLES[theirs.current_player()], str(action + 1))
            theirs.apply_action(action)
        assert ours.is_over() and ours.current_role() is None
        returns = ours.returns()
        assert [returns["x"], returns["o"]] == theirs.returns()


@functools.cache
def _ours_random_play(board: str) -> tuple[float, float, float]:
    game = TicTacToe()
    game.board = board
    game.history = [0] * (9 - board.count("."))
    if game.is_over():
        r = game.returns()["x"]
        return (float(r > 0), float(r < 0), float(r == 0))
    legal = game.legal_actions() or []
    total = [0.0, 0.0, 0.0]
    for a in legal:
        child = game.clone()
        child.apply(a)
        for i, p in enumerate(_ours_random_play(child.board)):
            total[i] += p / len(legal)
    return (total[0], total[1], total[2])


def _theirs_random_play(state: Any, memo: dict[str, tuple[float, ...]]) -> tuple[float, ...]:
    key = str(state)
    if key not in memo:
        if state.is_terminal():
            r = state.returns()[0]
            memo[key] = (float(r > 0), float(r < 0), float(r == 0))
        else:
            legal = state.legal_actions()
            total = [0.0, 0.0, 0.0]
            for a in legal:
                child = state.child(a)
                for i, p in enumerate(_theirs_random_play(child, memo)):
                    total[i] += p / len(legal)
            memo[key] = tuple(total)
    return memo[key]


def test_exact_random_play_outcomes_match_openspiel() -> None:
    ours = _ours_random_play("." * 9)
    theirs = _theirs_random_play(pyspiel.load_game("tic_tac_toe").new_initial_state(), {})
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert ours == pytest.approx(RANDOM_PLAY, abs=1e-12)


LEGAL = re.compile(r"Legal moves: ((?:\[\d\](?:, )?)+)")


def _uniform_move(ctx: ScriptContext) -> str:
    """A scripted model that plays uniformly at random (seeded by the request id)."""
    moves = re.findall(r"\[(\d)\]", LEGAL.findall(ctx.text)[-1])
    return f"[{random.Random(f'{ctx.rid} {ctx.text}').choice(moves)}]"


def test_random_play_statistics_through_the_environment(smollm2: ChatTokenizer) -> None:
    from agentenv import run_rollouts

    env = TicTacToeEnv(opponent="random", n_test=1500)
    tally = TallySink(_Null())
    anyio.run(
        lambda: run_rollouts(
            env,
            env.tasks("test"),
            ScriptedModel(smollm2, _uniform_move),
            tokenizer=smollm2,
            sink=tally,
            config=RolloutConfig(n_samples_per_prompt=2, concurrency=32),
        )
    )
    seats = tally.tally.summary()["seats"]
    n = seats["x"]["episodes"]
    assert n == seats["o"]["episodes"] == 1500
    se = (0.25 / n) ** 0.5
    assert abs(seats["x"]["win_rate"] - RANDOM_PLAY[0]) < 4 * se
    assert abs(seats["x"]["loss_rate"] - RANDOM_PLAY[1]) < 4 * se
    assert abs(seats["o"]["win_rate"] - RANDOM_PLAY[1]) < 4 * se
    assert abs(seats["o"]["draw_rate"] - RANDOM_PLAY[2]) < 4 * se
    assert seats["x"]["invalid_move_rate"] == 0.0


class _Null:
    async def put_group(self, samples: object) -> None:
        pass


def test_minimax_value_and_perfect_play() -> None:
    assert minimax("." * 9) == (0.0, (1, 2, 3, 4, 5, 6, 7, 8, 9))  # every opening draws
    assert minimax("xx.oo....")[1] == (3,)  # X completes the top row
    game, best, rand = TicTacToe(), MinimaxPlayer(), RandomPlayer()
    for seed in range(20):
        assert play_match(game, {"x": best, "o": best}, seed).returns == {"x": 0.0, "o": 0.0}
    for seed in range(150):
        assert play_match(game, {"x": best, "o": rand}, seed).returns["x"] >= 0
        assert play_match(game, {"x": rand, "o": best}, seed).returns["o"] >= 0


def test_observation_and_parsing() -> None:
    game = TicTacToe()
    game.reset(0)
    game.play("x", "5")
    (system, user) = game.observation("o")
    assert "Cells are numbered 1 to 9" in system["content"]
    assert user["content"] == (
        "You play O. Moves so far: X:5.\nBoard:\n1 | 2 | 3\n4 | X | 6\n7 | 8 | 9\n"
        "Legal moves: [1], [2], [3], [4], [6], [7], [8], [9]. Your move?"
    )
    assert game.parse("The corner. [ 1 ]") == "1"
    assert game.parse("[5]").reason.startswith("[5] is not a legal move now")  # type: ignore[union-attr]
