"""``agentenv bench engine`` and ``agentenv bench client`` run end to end (short runs: the
numbers themselves are recorded in docs/benchmarks.md, not asserted)."""

from __future__ import annotations

import json

import pytest

from agentenv.cli import main

pytestmark = pytest.mark.slow


def test_bench_engine_compares_with_hf_generate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--quick", "--levels", "1", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "engine" and result["device"] == "cpu"
    assert result["max_new_tokens"] == 32 and result["quick"] is True
    for level in ("1", "2"):
        row = result["levels"][level]
        assert row["engine_tokens_per_s"] > 0 and row["hf_generate_tokens_per_s"] > 0
        assert row["speedup"] == pytest.approx(
            row["engine_tokens_per_s"] / row["hf_generate_tokens_per_s"], rel=0.01
        )


def test_bench_engine_refuses_empty_levels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--levels", "0"]) == 2
    assert "--levels needs at least one positive concurrency" in capsys.readouterr().err


def test_bench_client_against_the_instant_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "client", "--quick", "--no-httpx", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = result["runs"]["agentenv"]
    assert run["in_flight"] == 4096 and run["requests"] == 10000
    assert result["requests_per_s"] == run["requests_per_s"] > 0
    assert result["runs"]["aiohttp"]["in_flight"] == 4096 and result["ratio_vs_aiohttp"] > 0
