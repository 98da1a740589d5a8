"""The two-agent word guess (environments/word_guess.py), driven by the scripted model: both
roles are rewarded for a guessed word, and a clue giver that says the word is penalised."""

from __future__ import annotations

import pytest

from agentenv import ChatTokenizer, ListSink, ScriptedModel, Task, run_rollouts
from environments.word_guess import CLUE_GIVER, GUESSER, WordGuessEnv
from tests.agentenv.test_environment import one_sample

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_two_agent_word_guess(smollm2: ChatTokenizer) -> None:
    def play(ctx) -> str:  # type: ignore[no-untyped-def]
        if "You are the clue giver" in ctx.text:
            return "It is a red fruit that keeps the doctor away."
        return "apple"

    env = WordGuessEnv(max_rounds=2)
    ts = [Task(id="a", answer="apple"), Task(id="b", answer="piano")]
    sink = ListSink()
    await run_rollouts(env, ts, ScriptedModel(smollm2, play), tokenizer=smollm2, sink=sink)
    roles = {(s.group_id.split("@")[0], s.role): s for s in sink.samples}  # type: ignore[union-attr]
    assert roles[("a", CLUE_GIVER)].reward == 1.0 and roles[("a", GUESSER)].reward == 1.0
    assert roles[("b", GUESSER)].reward == 0.0 and roles[("b", GUESSER)].metadata["turns"] == 2
    for s in sink.samples:
        if s.role == GUESSER:  # private information never reaches the guesser
            assert "piano" not in smollm2.decode(s.ids) or s.group_id.startswith("a")


async def test_word_guess_leak_penalised_and_hidden(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, lambda ctx: "The word is piano.")
    # One sample: the guesser never played, so it never saw the leaked clue.
    s = await one_sample(WordGuessEnv(), [Task(id="p", answer="piano")], model, smollm2)
    assert s.role == CLUE_GIVER and s.reward == -1.0 and s.metadata["leaked"] is True
