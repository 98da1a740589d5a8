"""GameEnv refuses a game whose moves are not strings before the first episode."""

from __future__ import annotations

import pytest

from agentenv import ChatTokenizer, ConfigError, GameEnv, ScriptedModel, run_rollouts
from tests.agentenv.games.test_game import IntMoves

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_game_with_int_moves_is_refused_before_any_episode(
    smollm2: ChatTokenizer,
) -> None:
    env = GameEnv(IntMoves)
    model = ScriptedModel(smollm2, [(".", "[1]")])
    with pytest.raises(ConfigError, match=r"IntMoves\.legal_actions\(\) must return moves as"):
        await run_rollouts(env, env.tasks("test")[:1], model)
