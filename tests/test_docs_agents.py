"""docs/agents.md shows an OpenAI-SDK agent trained by agentenv in under 40 lines, with the
names of the example that the test suite trains (examples/openai_agent_env.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_agents_doc_shows_the_usage_in_under_40_lines() -> None:
    doc = (ROOT / "docs" / "agents.md").read_text()
    usage = doc.split("## What happens to each call")[0]
    blocks = re.findall(r"```(?:python|bash)\n(.*?)```", usage, re.DOTALL)
    assert sum(len(b.splitlines()) for b in blocks) < 40
    example = (ROOT / "examples" / "openai_agent_env.py").read_text()
    assert "class CalculatorAgentEnv(AgentEnv):" in blocks[0]
    assert "class CalculatorAgentEnv(AgentEnv):" in example
    assert "examples/openai_agent_env.py:CalculatorAgentEnv" in blocks[1]
