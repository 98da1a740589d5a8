"""docs/ecosystem.md's verifiers section runs as written: its Python plays the tests'
single-turn verifiers taskset and prints what the comment says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ROOT / ".venv-verifiers" / "bin" / "python").exists(),
        reason="needs .venv-verifiers (make .venv-verifiers/.installed; `make test` makes it)",
    ),
]


def test_the_verifiers_section_runs() -> None:
    doc = (ROOT / "docs" / "ecosystem.md").read_text()
    section = doc.split("## verifiers environments", 1)[1].split("\n## ", 1)[0]
    (commands,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    (python,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert commands.strip() == "make .venv-verifiers/.installed"  # what `make test` ran
    out = subprocess.run(
        [sys.executable, "-c", python], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str([("completed", 1.0)] * 3)
