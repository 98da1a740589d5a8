"""The benches without a test of their own, each in its smallest form: a rollout level
and the Buffer's in-memory and durable modes (the children ``agentenv bench rollout`` and
``agentenv bench buffer`` run), and ``agentenv bench data-parallel`` on a one-layer model
(the numbers themselves are recorded in docs/benchmarks.md, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import run_child

pytestmark = pytest.mark.timeout(300)


def test_a_rollout_level_reports_turns_and_memory() -> None:
    result = run_child("benchmarks.rollout", ["--concurrency", "4", "--episodes", "16"])
    assert result["turns_per_s"] > 0 and result["overhead_us_per_turn"] > 0
    assert result["peak_rss_mb"] > 0


@pytest.mark.parametrize("mode", ["memory", "durable"])
def test_the_buffer_bench_moves_samples(mode: str) -> None:
    result = run_child("benchmarks.buffer", ["--mode", mode, "--groups", "32", "--producers", "4"])
    assert result["samples_per_s"] > 0


@pytest.mark.slow
def test_bench_data_parallel_compares_strategies_on_one_step() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "bench", "data-parallel", "--layers", "1",
         "--hidden", "32", "--vocab", "256", "--steps", "2", "--micro-batches", "2",
         "--batch", "1", "--tokens", "16", "--strategies", "one_process,ddp", "--json"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert set(result["strategies"]) == {"one_process", "ddp"}
    for row in result["strategies"].values():
        assert row["step_s"] > 0 and len(row["peak_mib"]) >= 1
