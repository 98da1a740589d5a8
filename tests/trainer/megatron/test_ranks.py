"""Rank 0 driving the other ranks (trainer.megatron._ranks) on CPU over gloo: collective
calls, bad input raised on every rank, a clean close, and a rank that dies."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentenv import ClosedResourceError
from tests.trainer.megatron.fake_ranks import Echo
from trainer.megatron import ProcessRanks


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


def test_one_rank_runs_here_without_processes() -> None:
    ranks: ProcessRanks[Echo] = ProcessRanks("tests.trainer.megatron.fake_ranks:Echo", "s", ["cpu"])
    assert ranks.world_size == 1 and ranks.procs == [] and ranks.exited() == {}
    assert ranks.local.rendezvous.rank == 0 and ranks.local.rendezvous.world_size == 1
    assert ranks.call(Echo.echo, 2, times=3) == ["s", 6]
    ranks.close()
    ranks.close()  # idempotent: the worker shuts down once
    assert ranks.local.shut == 1
    with pytest.raises(ClosedResourceError, match="cannot call echo: the ranks were closed"):
        ranks.call(Echo.echo, 1)


@pytest.mark.timeout(120)
def test_rank_0_failing_to_start_ends_the_ranks_it_started() -> None:
    """Otherwise they would wait for it in the rendezvous until the process exits."""
    factory = "tests.trainer.megatron.fake_ranks:BrokenRank0"
    started: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def record(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        started.append(popen(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(subprocess, "Popen", record)
        with pytest.raises(RuntimeError, match="rank 0 could not build"):
            ProcessRanks(factory, None, ["cpu", "cpu"])
    assert len(started) == 1 and started[0].returncode == -9  # SIGKILL, already reaped
