"""examples/mini_swe_agent_env.py -- mini-swe-agent, unchanged, acting in Harbor task
containers -- trained two steps by ``agentenv train`` on CPU (SmolLM2-135M)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv import Rubric
from examples.mini_swe_agent_env import MiniSweHarborEnv
from tests._train import even_share, train_two_steps

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow, pytest.mark.docker]


class ShapedMiniSweEnv(MiniSweHarborEnv):
    """The example unchanged, the tests' reward kept; plus a reward whose two samples of a
    group differ, so the two steps carry a gradient whether or not the model solves the
    task."""

    def __init__(self) -> None:
        super().__init__(step_limit=1)  # one call an episode: its ~1,050-token prompt
        self.rubric = Rubric(self.tests_reward, even_share)


def test_agentenv_train_trains_mini_swe_agent_on_harbor_tasks(tmp_path: Path) -> None:
    lines = train_two_steps(
        f"{__name__}:ShapedMiniSweEnv",
        tmp_path / "run",
        "--max-tokens-per-gpu",
        "4096",
        timeout=840,
    )
    # Two episodes a step, at least a sample each: mini-swe-agent drops a reply without a
    # tool call from its history (a format error), so its next call is a fresh
    # conversation, recorded as a sample of its own.
    assert all(m["failed_episodes"] == 0 and m["samples"] >= 2 for m in lines), lines
    trained = [m for m in lines if "train/grad_norm" in m]  # a step whose groups tie skips
    assert trained and all(m["train/grad_norm"] > 0 for m in trained)
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in trained)
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()
