"""docs/ecosystem.md's OpenEnv section runs as written: its commands write OpenEnv's echo
environment, its Python plays it and prints what the comment says."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # about 25 s on 2 cores


def test_the_openenv_section_runs(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "ecosystem.md").read_text()
    section = doc.split("## OpenEnv environments", 1)[1].split("\n## ", 1)[0]
    (commands,) = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    (python,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    where = str(tmp_path / "openenv")
    make, init = commands.strip().splitlines()
    assert make == "make .venv-openenv/.installed"  # what `make test` has already run
    init_argv = shlex.split(init.replace("/tmp/openenv", where))
    subprocess.run(init_argv, cwd=ROOT, check=True, capture_output=True, timeout=120)
    out = subprocess.run(
        [sys.executable, "-c", python.replace("/tmp/openenv", where)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[('truncated', 1.0), ('truncated', 1.0)]"
