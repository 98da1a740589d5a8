"""The OpenSpiel and PettingZoo adapters: chance sampled by the adapter, move names and
numbers, the AEC turn loop, and each one driving a GameEnv end to end."""

from __future__ import annotations

import random
import re
from collections import Counter

import anyio
import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    InvalidMove,
    ListSink,
    RandomPlayer,
    RolloutConfig,
    ScriptedModel,
    Status,
    play_match,
    run_rollouts,
)
from agentenv._scripted import ScriptContext
from agentenv.games import GameTally
from environments.games.tictactoe import TicTacToe

pytestmark = pytest.mark.timeout(120)


def first_offered(ctx: ScriptContext) -> str:
    moves = re.findall(r"\[([^\]]+)\]", ctx.text.rsplit("Legal moves:", 1)[1])
    return f"I play [{moves[0]}]"


def _run(env: object, tok: ChatTokenizer, n: int) -> list[object]:
    sink = ListSink()
    anyio.run(
        lambda: run_rollouts(
            env,  # type: ignore[arg-type]
            env.tasks("test")[:n],  # type: ignore[attr-defined]
            ScriptedModel(tok, first_offered),
            tokenizer=tok,
            sink=sink,
            config=RolloutConfig(concurrency=8),
        )
    )
    return list(sink.samples)


class TestOpenSpiel:
    def test_chance_is_sampled_by_the_adapter_from_its_seed(self) -> None:
        from environments.games.openspiel import OpenSpielGame

        game = OpenSpielGame("kuhn_poker")
        deals = Counter()
        for seed in range(1200):
            game.reset(seed)
            deals[game.state.history_str()] += 1
            assert not game.state.is_chance_node()
        assert len(deals) == 6 and all(150 < c < 250 for c in deals.values())
        game.reset(5)
        first = game.state.history_str()
        game.reset(5)
        assert game.state.history_str() == first

    def test_moves_differing_only_in_case_stay_apart(self) -> None:
        from environments.games.openspiel import OpenSpielGame

        game, rng = OpenSpielGame("chess"), random.Random(0)
        game.reset(0)
        for _ in range(60):  # random chess: names like "bxa6" and "Bxa6" both occur
            legal = game.legal_actions() or []
            assert len(legal) == len(game.state.legal_actions())
            move = rng.choice(legal)
            if move.lower() != move and sum(m.lower() == move.lower() for m in legal) == 1:
                assert game.normalize(move.lower()) == move  # a unique match in any case
            game.play(game.current_role() or "", move)
            if game.is_over():
                break

    def test_kuhn_random_play_value(self) -> None:
        from environments.games.openspiel import OpenSpielGame

        game, r = OpenSpielGame("kuhn_poker"), RandomPlayer()
        total = sum(
            play_match(game, {"player_0": r, "player_1": r}, s).returns["player_0"]
            for s in range(6000)
        )
        assert abs(total / 6000 - 1 / 8) < 0.06

    def test_moves_by_name_or_number_and_private_views(self) -> None:
        from environments.games.openspiel import OpenSpielGame

        game = OpenSpielGame("tic_tac_toe")
        game.reset(0)
        assert game.roles == ("player_0", "player_1") and game.name == "tic_tac_toe"
        assert game.legal_actions() == [f"x({r},{c})" for r in range(3) for c in range(3)]
        assert game.parse("the centre: [x(1,1)]") == "x(1,1)"
        assert game.parse("[4]") == "x(1,1)"  # OpenSpiel's action number
        assert isinstance(game.parse("[o(1,1)]"), InvalidMove)
        game.play("player_0", "x(1,1)")
        assert "Legal moves: [o(0,0)]" in game.observation("player_1")[1]["content"]
        twin = game.clone()
        twin.play("player_1", "o(0,0)")
        assert game.legal_actions() is not None and "o(0,0)" in game.legal_actions()  # type: ignore[operator]
        kuhn = OpenSpielGame("kuhn_poker")
        kuhn.reset(1)
        c0, c1 = kuhn.state.history()[:2]
        view = kuhn.observation("player_1")[1]["content"]
        assert kuhn.state.information_state_string(1) in view
        assert kuhn.state.information_state_string(0) not in view or c0 == c1

    def test_simultaneous_games_are_refused(self) -> None:
        from environments.games.openspiel import OpenSpielGame

        with pytest.raises(ConfigError, match="sequential games only; 'matrix_rps'"):
            OpenSpielGame("matrix_rps")

    def test_environment_end_to_end(self, smollm2: ChatTokenizer) -> None:
        from environments.games.openspiel import OpenSpielEnv

        env = OpenSpielEnv(game="kuhn_poker", opponent="random")
        samples = _run(env, smollm2, 20)
        tally = GameTally()
        tally.add(samples)  # type: ignore[arg-type]
        summary = tally.summary()
        assert set(summary["seats"]) == {"player_0", "player_1"}
        assert summary["invalid_move_rate"] == 0.0 and summary["failed_episodes"] == 0


class TestPettingZoo:
    def test_a_truncated_game_is_reported_truncated(self) -> None:
        from pettingzoo.classic.rps import rps
        from pettingzoo.classic.tictactoe import tictactoe

        from environments.games.pettingzoo_aec import PettingZooGame

        game, r = PettingZooGame(rps.env), RandomPlayer()
        play_match(game, dict.fromkeys(game.roles, r), 0)
        assert game.is_over() and game.truncated()  # rock-paper-scissors ends by its cap
        tic = PettingZooGame(tictactoe.env)
        play_match(tic, dict.fromkeys(tic.roles, r), 0)
        assert tic.is_over() and not tic.truncated()

    def test_tictactoe_agrees_with_ours(self) -> None:
        from pettingzoo.classic.tictactoe import tictactoe

        from environments.games.pettingzoo_aec import PettingZooGame

        game = PettingZooGame(tictactoe.env)
        assert game.roles == ("player_1", "player_2")
        to_ours = {"player_1": "x", "player_2": "o"}
        rng = random.Random(0)
        for g in range(60):
            game.reset(g)
            ours = TicTacToe()
            ours.reset(g)
            while (role := game.current_role()) is not None:
                assert to_ours[role] == ours.current_role()
                # PettingZoo numbers the cells column by column
                cells = sorted(int(a) % 3 * 3 + int(a) // 3 + 1 for a in game.legal_actions() or [])
                assert cells == [int(c) for c in ours.legal_actions() or []]
                action = rng.choice(game.legal_actions() or [])
                game.play(role, action)
                ours.play(to_ours[role], str(int(action) % 3 * 3 + int(action) // 3 + 1))
            assert ours.is_over()
            theirs = game.returns()
            assert {to_ours[r]: v for r, v in theirs.items()} == ours.returns()

    def test_environment_end_to_end(self, smollm2: ChatTokenizer) -> None:
        from environments.games.pettingzoo_aec import PettingZooEnv

        env = PettingZooEnv(opponent="random")
        samples = _run(env, smollm2, 10)
        assert {s.status for s in samples} == {Status.COMPLETED}  # type: ignore[attr-defined]
        prompt = smollm2.decode(samples[0].prompt_ids)  # type: ignore[attr-defined]
        assert "observation: [[[0, 0]" in prompt and "Legal moves: [0], [1]" in prompt

    def test_bad_factory(self) -> None:
        from environments.games.pettingzoo_aec import PettingZooEnv

        with pytest.raises(ConfigError, match=re.escape("expected module:function")):
            PettingZooEnv(env="tictactoe")
        with pytest.raises(
            ConfigError, match=re.escape("PettingZoo environment 'no_such.mod:env': cannot import")
        ):
            PettingZooEnv(env="no_such.mod:env")
