"""agentenv bench agent, small: the endpoint (agents in process and in a process of their
own; chat completions and Anthropic messages) and episode.generate run the same episodes
and report per call."""

from __future__ import annotations

import os

import pytest

from benchmarks.agent import bench

pytestmark = pytest.mark.timeout(120)


def test_bench_agent_measures_the_endpoint_against_episode_generate() -> None:
    affinity = os.sched_getaffinity(0)
    try:
        result = bench(episodes=16, concurrency=8, calls=3, rounds=1)
    finally:
        os.sched_setaffinity(0, affinity)  # the bench pins the process to one core
    assert result["calls"] == 48
    assert result["endpoint_calls_per_s"] > 0 and result["direct_calls_per_s"] > 0
    assert result["endpoint_us_per_call"] > result["direct_us_per_call"] > 0
    assert result["split_calls_per_s"] > 0 and result["http_noop_us_per_call"] > 0
    assert result["messages_us_per_call"] > result["direct_us_per_call"]
    assert result["messages_calls_per_s"] > 0 and result["messages_cpu_us_per_call"] > 0
    assert set(result["met"]) == {
        "calls_per_s", "overhead_us_per_call", "split_calls_per_s",
        "split_overhead_us_per_call", "split_overhead_cpu_us_per_call",
        "messages_calls_per_s", "messages_overhead_us_per_call",
    }  # fmt: skip
