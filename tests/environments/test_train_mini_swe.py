"""examples/mini_swe_agent_env.py -- mini-swe-agent, unchanged, acting in Harbor task
containers -- trained two steps by ``agentenv train`` on CPU (a tiny random Llama with
SmolLM2's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentenv import Rubric
from examples.mini_swe_agent_env import MiniSweHarborEnv
from tests._train import train_two_steps
from tests.trainer.test_loop import good_tokens, tiny_llama

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.docker]


class ShapedMiniSweEnv(MiniSweHarborEnv):
    """The example unchanged, the tests' reward kept; plus a reward the untrained tiny
    model can earn, so the two steps carry a gradient."""

    def __init__(self) -> None:
        super().__init__(step_limit=3)
        self.rubric = Rubric(self.tests_reward, good_tokens)


def test_agentenv_train_trains_mini_swe_agent_on_harbor_tasks(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    # The harness's prompt alone is ~1,050 tokens: give the rotary model room (it has no
    # learnt position table, so only the configured bound changes).
    config_file = model / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = 4096
    config_file.write_text(json.dumps(config))
    lines = train_two_steps(
        f"{__name__}:ShapedMiniSweEnv", model, tmp_path / "run",
        "--rollout-batch-size", "1", "--n-eval", "0", "--max-tokens-per-gpu", "4096",
        timeout=540,
    )  # fmt: skip
    # Two episodes a step, at least a sample each: mini-swe-agent drops a reply without a
    # tool call from its history (a format error), so its next call is a fresh
    # conversation, recorded as a sample of its own.
    assert all(m["failed_episodes"] == 0 and m["samples"] >= 2 for m in lines), lines
    assert any(m["train/grad_norm"] > 0 for m in lines)
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in lines)
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()
