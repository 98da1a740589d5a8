"""docs/ecosystem.md's mini-swe-agent section shows examples/mini_swe_agent_env.py verbatim
(the file tests/environments/test_train_mini_swe.py trains) and a command that runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def section() -> str:
    doc = (ROOT / "docs" / "ecosystem.md").read_text()
    return doc.split("## Command-line agents: mini-swe-agent", 1)[1].split("\n## ", 1)[0]


def test_the_mini_swe_section_shows_the_example_that_the_suite_trains() -> None:
    python = re.findall(r"```python\n(.*?)```", section(), re.DOTALL)
    assert (ROOT / "examples" / "mini_swe_agent_env.py").read_text() in python


@pytest.mark.docker
@pytest.mark.slow
def test_the_mini_swe_command_runs_as_shown() -> None:
    (command,) = re.findall(r"```bash\n(agentenv eval .*?)```", section(), re.DOTALL)
    argv = command.replace("\\\n", " ").split()
    out = subprocess.run(
        [str(Path(sys.executable).with_name("agentenv")), *argv[1:]],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["episodes"] == 2 and report["reward_mean"] == 1.0, report
