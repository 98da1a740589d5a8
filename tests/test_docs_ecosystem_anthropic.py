"""docs/ecosystem.md's Anthropic section shows examples/anthropic_agent_env.py verbatim (the
file examples/test_anthropic_agent_env.py plays) and a command that runs it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_anthropic_section_shows_the_example_that_the_suite_runs() -> None:
    doc = (ROOT / "docs" / "ecosystem.md").read_text()
    section = doc.split("## Anthropic-API agents", 1)[1].split("\n## ", 1)[0]
    python = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert (ROOT / "examples" / "anthropic_agent_env.py").read_text() in python
    (command,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    assert "examples/anthropic_agent_env.py:ClaudeAdderEnv" in command
    script = re.search(r"scripted:(\S+)", command)
    assert script is not None and (ROOT / script.group(1)).is_file()
