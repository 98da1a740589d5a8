"""Two steps of ``agentenv train`` on a tiny random Llama with SmolLM2's tokenizer (CPU), as
the ecosystem adapters' and examples' training tests run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: 2 steps of 2 prompts x 2 episodes, 8 tokens a reply; later flags override these.
TWO_STEPS = (
    "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
    "--rollout-max-response-len", "8", "--n-eval", "2", "--lr", "1e-3",
)  # fmt: skip


def train_two_steps(
    env: str,
    model: Path,
    save: Path,
    *flags: str,
    timeout: float = 240,
    env_vars: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``agentenv train --env ENV`` for two steps (``flags`` after :data:`TWO_STEPS`),
    check that it finished both, and return its metrics, a dict a step."""
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
