"""What a training run tells its user: steps that cannot learn, a skipped evaluation."""

from __future__ import annotations

import pytest

from agentenv import Sample
from trainer import TrainConfig
from trainer._loop import _rollout_metrics
from trainer._producer import RoundStats
from trainer._reporting import Reporter


def _sample(group: str, reward: float, role: str | None = None) -> Sample:
    return Sample(prompt_ids=[1], completion_ids=[2], reward=reward, group_id=group, role=role)


def test_groups_with_equal_rewards_are_counted() -> None:
    samples = [_sample("a", 1.0), _sample("a", 1.0), _sample("b", 0.0), _sample("b", 1.0)]
    assert _rollout_metrics(0, RoundStats(), samples)["rollout/zero_std_groups"] == 0.5
    # per prompt and role, as the advantages are computed
    game = [_sample("g", 1.0, "x"), _sample("g", 1.0, "x"), _sample("g", -1.0, "o")]
    assert _rollout_metrics(0, RoundStats(), game)["rollout/zero_std_groups"] == 1.0
    assert _rollout_metrics(0, RoundStats(), [])["rollout/zero_std_groups"] == 0.0


def _line(capsys: pytest.CaptureFixture[str], samples: list[Sample]) -> str:
    report = Reporter(TrainConfig(env="arithmetic", num_rollout=3), None, False)
    metrics = _rollout_metrics(0, RoundStats(), samples)
    metrics.update(time_rollout_s=1.0, time_train_s=1.0, time_sync_s=0.0)
    report(metrics)
    report.close()
    return capsys.readouterr().err


def test_a_step_that_cannot_learn_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    flat = _line(capsys, [_sample("a", 1.0), _sample("a", 1.0), _sample("b", 0.0)])
    assert flat.startswith("step 1/3  reward 0.667")
    assert "no signal: every group's rewards are equal" in flat
    mixed = _line(capsys, [_sample("a", 1.0), _sample("a", 0.0)])
    assert "no signal" not in mixed


def test_no_held_out_tasks_prints_skipped_not_none(capsys: pytest.CaptureFixture[str]) -> None:
    report = Reporter(TrainConfig(env="arithmetic"), None, False)
    report.held_out("before", None, 0)
    report.held_out("after", None, 0)
    report.held_out("before", 0.25, 8)
    assert capsys.readouterr().err.splitlines() == [
        "held-out reward: skipped (--n-eval 0)",
        "held-out reward before: 0.25",
    ]


def test_training_tasks_that_are_not_tasks_are_refused_naming_the_fix() -> None:
    from agentenv import ConfigError
    from trainer import GRPOConfig

    with pytest.raises(ConfigError, match=r"the training tasks must be agentenv\.Task objects"):
        GRPOConfig(rollout_batch_size=1).check_tasks([{"id": "a"}])  # type: ignore[list-item]
