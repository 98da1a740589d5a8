"""Every ``agentenv bench BENCH`` comes from the benchmarks package through an entry point
of ``agentenv.benches``, and the dispatcher lists each (``rollout`` with its ``--workers``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from agentenv.cli import main

ROOT = Path(__file__).resolve().parents[2]
BENCHES = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
    "agentenv.benches"
]


def test_every_bench_lives_in_the_benchmarks_package() -> None:
    assert {v.split(".")[0] for v in BENCHES.values()} == {"benchmarks"}


def test_agentenv_bench_lists_every_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr()
    assert "warning" not in out.err
    listed = {line.split()[0] for line in out.out.splitlines() if line.startswith("    ")}
    assert set(BENCHES) <= listed


def test_rollout_workers_join_the_rollout_bench(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "rollout", "--help"])
    out = capsys.readouterr().out
    assert "--no-verifiers" in out and "--workers N" in out
