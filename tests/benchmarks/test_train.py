"""``agentenv bench train`` (benchmarks/train.py) runs end to end on CPU on a tiny model (the
numbers themselves are recorded in docs/benchmarks.md, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_bench_train_runs_on_cpu() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "bench", "train", "--device", "cpu", "--hidden", "64",
         "--layers", "1", "--samples", "2", "--tokens", "32", "--steps", "1", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["ours"]["step_s"] > 0 and result["hf"]["step_s"] > 0
    assert result["speedup_vs_hf"] > 0
    assert "weight_sync_error" not in result, result.get("weight_sync_error")
    assert isinstance(result["weight_sync_s"], float)  # the sync into the engine was timed
