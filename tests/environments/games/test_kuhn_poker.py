"""Kuhn Poker against OpenSpiel's ``kuhn_poker``: every deal and betting line, the
uniform-play value (+1/8 for player 0), the Nash player's exploitability, and private
information: no prompt holds the other player's card or text."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Mapping
from typing import Any

import anyio
import pyspiel  # a dev dependency: the differential tests must run, never skip
import pytest

from agentenv import (
    ChatTokenizer,
    ListSink,
    Player,
    RandomPlayer,
    RolloutConfig,
    ScriptedModel,
    StrategyPlayer,
    play_match,
    run_rollouts,
)
from agentenv._scripted import ScriptContext
from environments.games.kuhn_poker import CARDS, ROLES, KuhnPoker, KuhnPokerEnv, NashPlayer

PASS_NAMES = ("check", "fold")


def _action_id(move: str) -> int:
    return 0 if move in PASS_NAMES else 1  # OpenSpiel: 0 = Pass, 1 = Bet


def _lines(state: Any, ours: KuhnPoker) -> int:
    """Walk every betting line below ``state`` in both games, comparing each step."""
    if state.is_terminal():
        assert ours.is_over()
        assert [ours.returns()[r] for r in ROLES] == state.returns()
        return 1
    role = ours.current_role()
    assert role == ROLES[state.current_player()]
    legal = ours.legal_actions() or []
    assert [_action_id(m) for m in legal] == state.legal_actions()
    total = 0
    for move in legal:
        child = ours.clone()
        child.play(role, move)
        total += _lines(state.child(_action_id(move)), child)
    return total


def test_every_deal_and_line_agrees_with_openspiel() -> None:
    game = pyspiel.load_game("kuhn_poker")
    leaves = 0
    for c0, c1 in itertools.permutations(range(3), 2):
        theirs = game.new_initial_state()
        theirs.apply_action(c0)
        theirs.apply_action(c1)
        ours = KuhnPoker()
        ours.reset(0)
        ours.cards = (c0, c1)
        leaves += _lines(theirs, ours)
    assert leaves == 6 * 5


def test_the_deal_is_uniform_and_seeded() -> None:
    game = KuhnPoker()
    deals = []
    for seed in range(1200):
        game.reset(seed)
        deals.append(game.cards)
    counts = {d: deals.count(d) for d in set(deals)}
    assert len(counts) == 6 and all(150 < c < 250 for c in counts.values())
    game.reset(7)
    again = KuhnPoker()
    again.reset(7)
    assert game.cards == again.cards


def _value(game: KuhnPoker, players: Mapping[str, StrategyPlayer]) -> float:
    """Player 0's exact expected return from here."""
    role = game.current_role()
    if role is None:
        return game.returns()[ROLES[0]]
    total = 0.0
    for move, p in players[role].strategy(game, role).items():
        if p:
            child = game.clone()
            child.play(role, move)
            total += p * _value(child, players)
    return total


def _exact(players: Mapping[str, StrategyPlayer]) -> float:
    total = 0.0
    for cards in itertools.permutations(range(3), 2):
        game = KuhnPoker()
        game.reset(0)
        game.cards = (cards[0], cards[1])
        total += _value(game, players) / 6
    return total


def test_uniform_play_is_worth_one_eighth_to_player_0() -> None:
    r = RandomPlayer()
    assert _exact({ROLES[0]: r, ROLES[1]: r}) == pytest.approx(1 / 8, abs=1e-12)
    from open_spiel.python.algorithms import expected_game_score
    from open_spiel.python.policy import UniformRandomPolicy

    game = pyspiel.load_game("kuhn_poker")
    uniform = UniformRandomPolicy(game)
    theirs = expected_game_score.policy_value(game.new_initial_state(), [uniform, uniform])
    assert theirs[0] == pytest.approx(1 / 8, abs=1e-12)
    # and by play: 20,000 hands
    game_ = KuhnPoker()
    mean = sum(
        play_match(game_, {ROLES[0]: r, ROLES[1]: r}, s).returns[ROLES[0]] for s in range(20000)
    )
    assert abs(mean / 20000 - 1 / 8) < 0.04


@pytest.mark.parametrize("alpha", [0.0, 1 / 6, 1 / 3])
def test_nash_player_is_unexploitable(alpha: float) -> None:
    from open_spiel.python.algorithms import exploitability
    from open_spiel.python.policy import TabularPolicy

    game = pyspiel.load_game("kuhn_poker")
    policy = TabularPolicy(game)
    nash = NashPlayer(alpha)
    for key, row in policy.state_lookup.items():  # "<card><history>", e.g. "1pb"
        card, history = int(key[0]), key[1:]
        ours = KuhnPoker()
        me = len(history) % 2
        ours.cards = (card, (card + 1) % 3) if me == 0 else ((card + 1) % 3, card)
        ours.history = history
        probs = nash.strategy(ours, ROLES[me])
        policy.action_probability_array[row] = [
            sum(p for m, p in probs.items() if _action_id(m) == a) for a in (0, 1)
        ]
    assert exploitability.nash_conv(game, policy) == pytest.approx(0.0, abs=1e-9)
    assert _exact({r: nash for r in ROLES}) == pytest.approx(-1 / 18, abs=1e-12)


def test_observations_depend_only_on_the_information_state() -> None:
    """Two states look the same to a player exactly when OpenSpiel says they are
    indistinguishable for it: no private information leaks into an observation."""
    game = pyspiel.load_game("kuhn_poker")
    seen: dict[tuple[int, str], str] = {}
    for c0, c1 in itertools.permutations(range(3), 2):
        for history in ("", "p", "b", "pb"):
            theirs = game.new_initial_state()
            for a in (c0, c1, *(0 if h == "p" else 1 for h in history)):
                theirs.apply_action(a)
            ours = KuhnPoker()
            ours.cards, ours.history = (c0, c1), history
            for p, role in enumerate(ROLES):
                text = "\n".join(m["content"] for m in ours.observation(role))
                key = (p, theirs.information_state_string(p))
                assert seen.setdefault(key, text) == text
    # and distinct information states look different
    assert len(set(seen.values())) == len(seen)


def test_no_prompt_holds_the_other_players_card_or_text(smollm2: ChatTokenizer) -> None:
    prompts: dict[str, list[str]] = {r: [] for r in ROLES}

    def script(ctx: ScriptContext) -> str:
        assert ctx.rid is not None
        role = ctx.rid.split("/")[2]
        prompts[role].append(ctx.text)
        card = re.findall(r"Your card: (\w)", ctx.text)[-1]
        moves = re.findall(r"\[(\w+)\]", ctx.text.rsplit("Legal moves:", 1)[1])
        move = moves[1] if card == "K" else moves[0]
        return f"SECRET-{role}: I hold the {card}, so I {move}. [{move}]"

    env = KuhnPokerEnv()
    sink = ListSink()
    anyio.run(
        lambda: run_rollouts(
            env,
            env.tasks("test")[:60],
            ScriptedModel(smollm2, script),
            tokenizer=smollm2,
            sink=sink,
            config=RolloutConfig(n_samples_per_prompt=2),
        )
    )
    assert all(prompts.values())
    for s in sink.samples:
        assert s.role is not None
        other = ROLES[1 - ROLES.index(s.role)]
        prompt = smollm2.decode(s.prompt_ids)
        assert f"SECRET-{other}" not in prompt and "SECRET-" not in prompt
        mine = re.findall(r"Your card: (\w)", prompt)
        assert len(mine) == 1
        # the other card appears nowhere but in the rules' list of the deck
        theirs = set(CARDS) - {mine[0]}
        body = prompt.split("Your card:", 1)[1]
        assert not any(re.search(rf"\b{c}\b", body) for c in theirs)
    # the betting the opponent sees is the parsed move only
    assert any("Betting so far: player_0 bets" in p for p in prompts["player_1"])


def test_nash_opponent_in_the_environment(smollm2: ChatTokenizer) -> None:
    opponent: Player = NashPlayer()
    env = KuhnPokerEnv(opponent=opponent, seat="player_0")
    model = ScriptedModel(
        smollm2, lambda ctx: "[check]" if "[check]" in ctx.text.rsplit("Legal", 1)[1] else "[fold]"
    )
    sink = ListSink()
    anyio.run(
        lambda: run_rollouts(env, env.tasks("test")[:50], model, tokenizer=smollm2, sink=sink)
    )
    finals = [s for s in sink.samples if s.metadata.get("final")]
    assert len(finals) == 50 and {s.role for s in finals} == {"player_0"}
    assert all(s.metadata["outcome"] in ("win", "loss") for s in finals)
    # check-folding loses at most the ante
    assert all(s.metadata["return"] in (-1.0, 1.0) for s in finals)
    rng = random.Random(0)
    assert NashPlayer().act(_after_deal(2), ROLES[0], rng) == "check"  # alpha 0: K checks


def _after_deal(card: int) -> KuhnPoker:
    game = KuhnPoker()
    game.reset(0)
    game.cards = (card, (card + 1) % 3)
    return game
