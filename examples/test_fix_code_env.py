"""The code-fixing episode scripted: a wrong fix, the failing test's traceback, the right
fix, the passing run."""

from __future__ import annotations

from fix_code_env import FixCodeEnv

import agentenv
from agentenv import ChatTokenizer, ScriptedModel


def call(code: str) -> str:
    # A rule's reply is a match.expand() template: "\\\\n" there is "\\n" in the JSON.
    body = code.replace("\n", "\\\\n")
    return f'<tool_call>{{"name": "run_tests", "arguments": {{"code": "{body}"}}}}</tool_call>'


def test_fix_code_env() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    rules = [
        (r"fails its tests", call("def add(a, b):\n    return a * b\n")),
        (r"AssertionError", call("def add(a, b):\n    return a + b\n")),
        (r"all tests passed", "Fixed: add returns a + b."),
    ]
    result = agentenv.run(FixCodeEnv(), ScriptedModel(tok, rules))
    [sample] = result.samples
    assert sample.reward == 1.0
    assert sample.metadata["test_runs"] == 2 and sample.metadata["tool_calls"] == 2
    # The model was shown only the code parameter; the tests came from the task.
    assert '"task"' not in tok.decode(sample.prompt_ids)
    assert "AssertionError" in tok.decode(sample.completion_ids)
