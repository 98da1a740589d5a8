"""The anthropic-SDK agent scripted: the first reply calls add, the second reads its
result (a ``tool`` turn in SmolLM2's template) and answers."""

from __future__ import annotations

from pathlib import Path

from anthropic_agent_env import ClaudeAdderEnv

import agentenv
from agentenv import ChatTokenizer, ScriptedModel


def test_the_script_file_plays_the_anthropic_agent() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    script = Path(__file__).parent / "scripts" / "anthropic_adder.json"
    env = ClaudeAdderEnv()
    result = agentenv.run(env, ScriptedModel.from_file(script, tok), tasks=env.tasks()[:2])
    assert [s.reward for s in result.samples] == [1.0, 1.0]
    assert all(s.metadata["tool_calls"] == 1 and s.metadata["turns"] == 2 for s in result.samples)
    mask = list(result.samples[0].loss_mask or [])
    assert 0 in mask and mask[0] == 1 and mask[-1] == 1
