"""A ToolEnv whose tool comes from an MCP server: the server is started for the run, its
tools and schemas are read from it (tested offline in ``test_mcp_tool_env.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

from agentenv import MCPServer, Rubric, State, Task, ToolEnv

SERVER = Path(__file__).with_name("mcp_calculator_server.py")


def correct(task: Task, state: State) -> float:
    return 1.0 if state.completion.strip() == f"The answer is {task.answer}." else 0.0


class MCPAddEnv(ToolEnv):
    name = "mcp_add"
    system_prompt = "Use the add tool, then reply 'The answer is N.'"
    mcp_servers = (MCPServer([sys.executable, str(SERVER)], timeout_s=10),)
    max_turns = 3
    rubric = Rubric(correct)

    def tasks(self, split: str = "train") -> list[Task]:
        pairs = [(2, 3), (10, 32)]
        return [Task(id=f"{a}+{b}", prompt=f"What is {a} + {b}?", answer=a + b) for a, b in pairs]
