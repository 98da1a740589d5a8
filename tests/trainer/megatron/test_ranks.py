"""Rank 0 driving the other ranks (trainer.megatron._ranks) on CPU over gloo: collective
calls, bad input raised on every rank, a clean close, and a rank that dies."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.trainer.megatron.fake_ranks", mode],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.timeout(180)
def test_rank0_drives_the_other_ranks_and_closes_them() -> None:
    out = _run("ok")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "add 6",
        "refused bad input, found on every rank",
        "add 12",
        "closed",
    ]


@pytest.mark.timeout(180)
def test_a_rank_that_dies_ends_the_run_instead_of_a_hang() -> None:
    out = _run("die")
    assert out.returncode == 1 and "not reached" not in out.stdout
    # The watchdog's message, or gloo's own error when it notices first.
    assert (
        "megatron rank 1 exited with status 3" in out.stderr
        or "by peer" in out.stderr  # "Connection reset by peer", "... closed by peer"
    ), out.stderr[-2000:]
