"""examples/anthropic_agent_env.py -- an agent written only against the anthropic SDK,
through the endpoint's /v1/messages -- trained two steps by ``agentenv train`` on CPU
(SmolLM2-135M)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv import Rubric
from examples.anthropic_agent_env import ClaudeAdderEnv
from tests._train import even_share, train_two_steps

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


class ShapedClaudeAdderEnv(ClaudeAdderEnv):
    """The example's agent unchanged; a reward whose two samples of a group differ."""

    rubric = Rubric(even_share)


def test_agentenv_train_trains_the_anthropic_agent_unchanged(tmp_path: Path) -> None:
    lines = train_two_steps(f"{__name__}:ShapedClaudeAdderEnv", tmp_path / "run")
    assert all(m["failed_episodes"] == 0 and m["samples"] == 2 for m in lines)
    trained = [m for m in lines if "train/grad_norm" in m]  # a step whose groups tie skips
    assert trained and all(m["train/grad_norm"] > 0 for m in trained)
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in trained)
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()
