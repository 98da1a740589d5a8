"""examples/anthropic_agent_env.py -- an agent written only against the anthropic SDK,
through the endpoint's /v1/messages -- trained two steps by ``agentenv train`` on CPU (a
tiny random Llama with SmolLM2's tokenizer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentenv import Rubric
from examples.anthropic_agent_env import ClaudeAdderEnv
from tests.trainer.test_loop import good_tokens, tiny_llama

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class ShapedClaudeAdderEnv(ClaudeAdderEnv):
    """The example's agent unchanged; a reward the untrained tiny model can earn."""

    rubric = Rubric(good_tokens)


def test_agentenv_train_trains_the_anthropic_agent_unchanged(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "train",
         "--env", f"{__name__}:ShapedClaudeAdderEnv", "--hf-checkpoint", str(model),
         "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--rollout-max-response-len", "8", "--n-eval", "2", "--lr", "1e-3",
         "--save", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    assert all(m["failed_episodes"] == 0 and m["samples"] == 4 for m in lines)
    assert any(m["train/grad_norm"] > 0 for m in lines)  # the agent's samples carry signal
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in lines)
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()
