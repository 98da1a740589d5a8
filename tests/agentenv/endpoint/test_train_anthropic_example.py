"""examples/anthropic_agent_env.py -- an agent written only against the anthropic SDK,
through the endpoint's /v1/messages -- trained two steps by ``agentenv train`` on CPU (a
tiny random Llama with SmolLM2's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv import Rubric
from examples.anthropic_agent_env import ClaudeAdderEnv
from tests._train import train_two_steps
from tests.trainer.test_loop import good_tokens, tiny_llama

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class ShapedClaudeAdderEnv(ClaudeAdderEnv):
    """The example's agent unchanged; a reward the untrained tiny model can earn."""

    rubric = Rubric(good_tokens)


def test_agentenv_train_trains_the_anthropic_agent_unchanged(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    lines = train_two_steps(f"{__name__}:ShapedClaudeAdderEnv", model, tmp_path / "run")
    assert all(m["failed_episodes"] == 0 and m["samples"] == 4 for m in lines)
    assert any(m["train/grad_norm"] > 0 for m in lines)  # the agent's samples carry signal
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in lines)
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()
