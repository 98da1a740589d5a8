"""``agentenv bench judge`` in its smallest form: both measurements report."""

from __future__ import annotations

import anyio
import pytest

from benchmarks.judge import bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_judge_bench_reports_throughput_and_the_hit_rate() -> None:
    out = anyio.run(bench, "smollm2-135m", 4, 2, 3)
    assert out["throughput"]["judgements"] == 4 and out["throughput"]["judgements_per_s"] > 0
    for kind in ("whole_reply", "final_answer"):
        groups = out["grpo_groups"][kind]
        assert groups["judgements"] == 6
        assert groups["judge_calls"] + round(groups["hit_rate"] * 6) == 6
        assert 0.0 <= groups["agreement_with_verifier"] <= 1.0
