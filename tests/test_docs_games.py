"""docs/games.md shows a complete game in under 60 lines: the example file, verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_games_doc_shows_the_example_game_verbatim_in_under_60_lines() -> None:
    doc = (ROOT / "docs" / "games.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.DOTALL)
    example = (ROOT / "examples" / "race_to_21.py").read_text()
    assert example in blocks
    lines = len(example.splitlines())
    assert lines < 60
    assert f"in {lines} lines" in doc
