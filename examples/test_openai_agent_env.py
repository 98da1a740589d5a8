"""The openai-SDK agent scripted: the first reply calls the calculator, the second reads
its result (a ``tool`` turn in SmolLM2's template) and answers."""

from __future__ import annotations

from openai_agent_env import CalculatorAgentEnv, calculator

import agentenv
from agentenv import ChatTokenizer, ScriptedModel


def test_calculator_agent_env() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    call = '{"name": "calculator", "arguments": {"expression": "\\1 * \\2"}}'
    rules = [
        (r"What is (\d+) \* (\d+)\?", f"<tool_call>{call}</tool_call>"),
        (r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", r"The answer is \1."),
    ]
    env = CalculatorAgentEnv()
    result = agentenv.run(env, ScriptedModel(tok, rules), tasks=env.tasks()[:2])
    assert [s.reward for s in result.samples] == [1.0, 1.0]
    assert all(s.metadata["tool_calls"] == 1 and s.metadata["turns"] == 2 for s in result.samples)
    mask = list(result.samples[0].loss_mask)
    assert 0 in mask and mask[0] == 1 and mask[-1] == 1


def test_the_calculator_tool_evaluates_integer_arithmetic_only() -> None:
    assert calculator("3 * (4 + 2) - 1") == "17"
    assert calculator("9 ** 9").startswith("error")
    assert calculator("__import__('os')").startswith("error")


def test_the_script_file_plays_the_agent() -> None:
    from pathlib import Path

    tok = ChatTokenizer.load("smollm2-135m")
    script = Path(__file__).parent / "scripts" / "calculator_agent.json"
    env = CalculatorAgentEnv()
    result = agentenv.run(env, ScriptedModel.from_file(script, tok), tasks=env.tasks("test")[:2])
    assert [s.reward for s in result.samples] == [1.0, 1.0]
