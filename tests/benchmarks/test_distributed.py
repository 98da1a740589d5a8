"""``agentenv bench distributed --quick``: the run in one process and on a Ray of its own,
the stages of placing a run and the weight syncs into two engine actors, each reported with
positive times (the numbers themselves are the bench's, not the test's)."""

from __future__ import annotations

import argparse
import json
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from benchmarks import distributed as bench

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["distributed", *argv])


def test_agentenv_bench_distributed_is_the_registered_bench() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"]["agentenv.benches"]["distributed"]
    assert EntryPoint("distributed", value, "agentenv.benches").load() is bench.add_parser


def test_an_unknown_run_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="--runs 'ray,gpu': unknown \\['gpu'\\]"):
        bench.run(_args("--runs", "ray,gpu"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_quick_bench_reports_every_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray")
    args = _args("--quick", "--json")
    assert args.handler(args) == 0
    captured = capsys.readouterr()
    result: dict[str, Any] = json.loads(captured.out.strip().splitlines()[-1])
    assert "ray / in_process, steady step:" in captured.err  # the table
    assert result["bench"] == "distributed" and result["quick"] is True
    assert set(result["runs"]) == {"in_process", "ray"}
    for name, r in result["runs"].items():
        assert r["steps"] == 2 and len(r["step_s"]) == 2, name
        assert all(t > 0 for t in r["step_s"]) and r["steady_step_s"] > 0
        assert r["command"].startswith("agentenv train ") and r["wall_s"] > 0
    assert "--ray-address local --rollout-num-gpus 1" in result["runs"]["ray"]["command"]
    assert "--ray-address" not in result["runs"]["in_process"]["command"]
    assert result["ratio"]["ray_over_in_process"] > 0
    assert isinstance(result["ratio"]["met"], bool)
    start = result["start"]
    assert start["engines"] == 2 and start["trainer_ranks"] == 1
    parts = ("ray_init_s", "placement_s", "trainer_ranks_s", "engines_ready_s")
    assert all(start[k] > 0 for k in parts)
    assert start["total_s"] == pytest.approx(sum(start[k] for k in parts), abs=0.01)
    sync = result["sync"]
    assert sync["engines"] == 2 and sync["parameters"] > 0
    for kind in ("disk", "distributed"):
        assert len(sync[kind]["s"]) == 1 and sync[kind]["median_s"] > 0
    colocated = result["sync_colocated"]
    assert colocated["engines"] == 2 and colocated["trainer_ranks"] == 2
    for kind in ("disk", "tensor"):
        assert len(colocated[kind]["s"]) == 1 and colocated[kind]["median_s"] > 0
