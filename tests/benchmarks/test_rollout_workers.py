"""``agentenv bench rollout --workers 2`` on three hosts in network namespaces (a Ray head,
a one-CPU node per worker): every way of playing reports its episodes/s (the numbers
themselves are recorded in docs/benchmarks.md, not asserted)."""

from __future__ import annotations

import pytest

from benchmarks.hosts import available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


def test_the_rollout_bench_runs_workers_on_namespace_hosts() -> None:
    import argparse

    from benchmarks.rollout_workers import run

    args = argparse.Namespace(workers=2, episodes=32, cpu_ms=5.0, local=False)
    result = run(args)
    assert result["episodes"] == 32 and len(result["hosts"]) == 3
    for way in ("in_process", "workers_1", "workers_2"):
        assert result[f"{way}_episodes_per_s"] > 0
    assert result["speedup"] > 0 and result["overhead_ratio"] > 0
    assert isinstance(result["speedup_met"], bool)
