"""The README's example is the code in examples/, which the test suite runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_shows_the_example_files_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    for name in ("reverse_env.py", "test_reverse_env.py"):
        assert (ROOT / "examples" / name).read_text() in blocks, name


def test_readme_example_is_under_40_lines() -> None:
    lines = sum(
        len((ROOT / "examples" / n).read_text().splitlines())
        for n in ("reverse_env.py", "test_reverse_env.py")
    )
    assert lines < 40


def test_readme_has_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
