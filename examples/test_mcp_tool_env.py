"""The MCP tool episode scripted, as test_add_tool_env.py scripts the local tool's."""

from __future__ import annotations

from mcp_tool_env import MCPAddEnv

import agentenv
from agentenv import ChatTokenizer, ScriptedModel


def test_mcp_add_env() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    rules = [
        (
            r"What is (\d+) \+ (\d+)\?",
            '<tool_call>\n{"name": "add", "arguments": {"a": \\1, "b": \\2}}\n</tool_call>',
        ),
        (r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", r"The answer is \1."),
    ]
    result = agentenv.run(MCPAddEnv(), ScriptedModel(tok, rules))
    assert [s.reward for s in result.samples] == [1.0, 1.0]
    assert all(s.metadata["tool_calls"] == 1 for s in result.samples)
