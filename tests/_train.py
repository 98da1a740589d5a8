"""Two steps of ``agentenv train`` on SmolLM2-135M-Instruct (CPU), as the ecosystem
adapters' and examples' training tests run them, and a reward with signal for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentenv import State, Task

ROOT = Path(__file__).resolve().parents[1]

SMOLLM2 = "smollm2-135m"
"""The real model of the CPU runs (``--hf-checkpoint`` takes the name)."""

#: 2 steps of 1 prompt x 2 episodes, 8 tokens a reply, no held-out evaluation; later flags
#: override these.
TWO_STEPS = (
    "--num-rollout", "2", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
    "--rollout-max-response-len", "8", "--n-eval", "0", "--lr", "1e-5",
)  # fmt: skip


def even_share(task: Task, state: State) -> float:
    """The share of the last reply's tokens whose id is even: a reward that two sampled
    replies almost never tie on, so a group of two carries a gradient whatever the task."""
    ids = state.transcript.current.completion_ids
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


def train_two_steps(
    env: str,
    save: Path,
    *flags: str,
    model: str | Path = SMOLLM2,
    timeout: float = 420,
    env_vars: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``agentenv train --env ENV`` for two steps on ``model`` (``flags`` after
    :data:`TWO_STEPS`), check that it finished both, and return its metrics, a dict a step."""
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "train", "--env", env, "--hf-checkpoint", str(model),
         *TWO_STEPS, *flags, "--save", str(save), "--json"],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, **(env_vars or {})},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1])["steps"] == 2
    lines = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    return lines
