"""What a training run tells its user: steps that cannot learn, a skipped evaluation."""

from __future__ import annotations

import pytest

from agentenv import Sample
from trainer import TrainConfig
from trainer.run._loop import _rollout_metrics
from trainer.run._producer import RoundStats
from trainer.run._reporting import Reporter


def _sample(group: str, reward: float, role: str | None = None) -> Sample:
    return Sample(prompt_ids=[1], completion_ids=[2], reward=reward, group_id=group, role=role)


def test_groups_with_equal_rewards_are_counted() -> None:
    samples = [_sample("a", 1.0), _sample("a", 1.0), _sample("b", 0.0), _sample("b", 1.0)]
    assert _rollout_metrics(0, RoundStats(), samples)["rollout/zero_std_groups"] == 0.5
    # per prompt and role, as the advantages are computed
    game = [_sample("g", 1.0, "x"), _sample("g", 1.0, "x"), _sample("g", -1.0, "o")]
    assert _rollout_metrics(0, RoundStats(), game)["rollout/zero_std_groups"] == 1.0
    assert _rollout_metrics(0, RoundStats(), [])["rollout/zero_std_groups"] == 0.0


def _line(
    capsys: pytest.CaptureFixture[str], samples: list[Sample], extra: dict[str, float] | None = None
) -> str:
    report = Reporter(TrainConfig(env="arithmetic", num_rollout=3), None, False)
    metrics = _rollout_metrics(0, RoundStats(), samples)
    metrics.update(time_rollout_s=1.0, time_train_s=1.0, time_sync_s=0.0, **(extra or {}))
    report(metrics)
    report.close()
    return capsys.readouterr().err


def test_a_step_that_cannot_learn_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    flat = _line(capsys, [_sample("a", 1.0), _sample("a", 1.0), _sample("b", 0.0)])
    assert flat.startswith("step 1/3  reward 0.667")
    assert "no signal: every group's rewards are equal" in flat
    mixed = _line(capsys, [_sample("a", 1.0), _sample("a", 0.0)])
    assert "no signal" not in mixed and "skipped" not in mixed
    skipped = _line(
        capsys, [_sample("a", 1.0), _sample("a", 1.0)], {"train/skipped_no_gradient": 1}
    )
    assert "no signal: every group's rewards are equal  (training skipped: 1 step(s))" in skipped


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


def test_game_steps_log_per_role_reward_win_rate_and_invalid_moves() -> None:
    def turn(role: str, reward: float, outcome: str, invalid: int) -> Sample:
        meta = {"outcome": outcome, "return": reward, "attempts": 1 + invalid,
                "invalid": invalid, "final": True}  # fmt: skip
        return Sample(prompt_ids=[1], completion_ids=[2], reward=reward, group_id="g",
                      role=role, metadata=meta)  # fmt: skip

    samples = [turn("x", 1.0, "win", 1), turn("o", -1.0, "loss", 0)]
    metrics = _rollout_metrics(0, RoundStats(), samples)
    assert metrics["game/x/win_rate"] == 1.0 and metrics["game/o/loss_rate"] == 1.0
    assert metrics["game/x/reward_mean"] == 1.0 and metrics["game/o/reward_mean"] == -1.0
    assert metrics["game/x/invalid_move_rate"] == 0.5 and metrics["game/invalid_move_rate"] == 1 / 3
    # not a game: no game/ metrics
    assert not any(
        k.startswith("game/") for k in _rollout_metrics(0, RoundStats(), [_sample("a", 1.0)])
    )


def test_the_peak_resident_set_covers_every_process_of_the_run() -> None:
    """``perf/peak_rss_gib`` is the largest of every role's (this process, the ranks, the
    engines with their servers, the rollout workers on Ray), each also under its name;
    a server's peak is its processes' largest."""
    import os
    import subprocess
    import sys

    import torch

    from trainer._resources import peak_rss_gib
    from trainer.run._loop import _peak_memory

    # A child that starts a grandchild which touches 300 MiB, says so, and waits.
    grow = "x = bytearray(300 * 2**20); x[::4096] = b'a' * (len(x) // 4096); print('ok'); input()"
    start = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grow!r}])"
    child = subprocess.Popen(
        [sys.executable, "-c", start], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ok\n"
        server = peak_rss_gib(child.pid, descendants=True)
        assert peak_rss_gib(child.pid) < 0.29 < server
        assert peak_rss_gib(os.getpid(), descendants=True) >= server
    finally:
        child.communicate("\n", timeout=60)
    ours = _peak_memory(torch.device("cpu"), {"perf/peak_rss_gib/engines": 64.0, "loss": 1.0})
    assert ours["perf/peak_rss_gib"] == 64.0 and ours["perf/peak_rss_gib/engines"] == 64.0
    assert 0 < ours["perf/peak_rss_gib/driver"] == pytest.approx(peak_rss_gib(), rel=0.1)
    alone = _peak_memory(torch.device("cpu"), {})
    assert alone["perf/peak_rss_gib"] == alone["perf/peak_rss_gib/driver"]
