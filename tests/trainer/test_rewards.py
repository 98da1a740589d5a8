"""The trainer's reward wiring: rounds in which every sample failed stop the run after
``--max-failed-rounds`` (not replayed without end), and the reward flags (``remote_rm``'s
bounds, a TRL function on ``--custom-rm-path`` with ``--label-key``) reach the rubric."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentenv import (
    ChatTokenizer,
    Rubric,
    SamplingParams,
    ScriptedModel,
    SingleTurnEnv,
    State,
    Status,
    Task,
    run,
)
from agentenv.buffer import Buffer
from trainer import GRPOConfig
from trainer.config._envs import build_env
from trainer.run._flags import add_train_arguments, config_from_args
from trainer.run._producer import FailedRoundsError, Producer, TaskStream
from trainer.run._setup import env_spec

pytestmark = pytest.mark.timeout(120)

TASKS = [Task(id=f"t{i}", prompt="2+2?", answer="4") for i in range(4)]
BUFFER = GRPOConfig(rollout_batch_size=1, n_samples_per_prompt=4).buffer_config()


class Scored(SingleTurnEnv):
    pass


def producer_for(
    rubric: Rubric, smollm2: ChatTokenizer, buffer: Buffer, n: int, **kw: Any
) -> Producer:
    env = Scored()
    env.rubric = rubric
    config = GRPOConfig(
        rollout_batch_size=1, n_samples_per_prompt=n, sampling=SamplingParams(), **kw
    )
    return Producer(
        env, TaskStream(TASKS, seed=0, shuffle=False), ScriptedModel(smollm2, [], default="4"),
        smollm2, buffer, config, concurrency=4,
    )  # fmt: skip


def test_rounds_in_which_every_sample_failed_stop_the_run(smollm2: ChatTokenizer) -> None:
    calls: list[str] = []

    def service_down(task: Task, state: State) -> float:
        calls.append(task.id)
        raise ConnectionError("reward service at 127.0.0.1:9 refused the connection")

    producers: list[Producer] = []

    async def go() -> None:
        async with Buffer(BUFFER) as buffer:
            producers.append(producer_for(Rubric(service_down), smollm2, buffer, 4,
                                          max_failed_rounds=3))  # fmt: skip
            for step in range(10):  # each step would play up to max_rounds (8) rounds
                await producers[0].fill(step, 1)

    with pytest.raises(FailedRoundsError) as caught:
        anyio.run(go)
    message = str(caught.value)
    assert message.startswith("3 rounds in a row failed every sample; the last round's ")
    assert "ConnectionError: reward service at 127.0.0.1:9 refused the connection" in message
    assert "--max-failed-rounds" in message
    stats = producers[0].stats  # three rounds, then the run stopped
    assert stats.rounds == 3 and len(calls) == stats.episodes == stats.failed


def test_a_round_with_a_good_sample_resets_the_count(smollm2: ChatTokenizer) -> None:
    # One sample a round: fail, fail, good (the count starts again), fail, good, good,
    # then fail three times: the run stops at the ninth round.
    outcomes = iter([False, False, True, False, True, True, False, False, False])

    def flaky(task: Task, state: State) -> float:
        if not next(outcomes):
            raise ConnectionError("down")
        return 1.0

    async def go() -> int:
        async with Buffer() as buffer:
            producer = producer_for(Rubric(flaky), smollm2, buffer, 1, max_failed_rounds=3)
            played = 0

            async def rounds() -> None:
                nonlocal played
                for _ in range(20):
                    await producer.play(TASKS[:1], seed=played)
                    played += 1

            with pytest.raises(FailedRoundsError, match="3 rounds in a row"):
                await rounds()
            return played

    assert anyio.run(go) == 8


def _config(tmp_path: Path, *argv: str) -> Any:
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": [{"role": "user", "content": "2+2?"}], "solution": "4"}\n')
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(
        ["--prompt-data", str(data), "--input-key", "question", "--label-key", "solution",
         *argv]
    ))  # fmt: skip


def test_remote_rm_bounds_and_max_failed_rounds_are_flags(tmp_path: Path) -> None:
    config = _config(
        tmp_path, "--rm-type", "remote_rm", "--rm-url", "http://127.0.0.1:9/reward",
        "--rm-timeout", "7.5", "--rm-max-response-bytes", "4096", "--max-failed-rounds", "5",
    )  # fmt: skip
    assert config.rollout.max_failed_rounds == 5
    env = build_env(env_spec(config))
    ((rule, _),) = env.rubric.funcs
    assert (rule.remote.timeout_s, rule.remote.max_response_bytes) == (7.5, 4096)
    assert _config(tmp_path, "--rm-type", "f1").rollout.max_failed_rounds == 3


def test_a_trl_function_on_custom_rm_path_reads_the_label_key_column(
    tmp_path: Path, smollm2: ChatTokenizer
) -> None:
    path = tmp_path / "trl_rewards.py"
    path.write_text(
        "def accuracy_reward(completions, solution, **kwargs):\n"
        "    return [c[0]['content'] == s for c, s in zip(completions, solution)]\n"
    )
    config = _config(tmp_path, "--custom-rm-path", f"{path}:accuracy_reward")
    env = build_env(env_spec(config))
    for reply, reward in (("4", 1.0), ("5", 0.0)):
        model = ScriptedModel(smollm2, [], default=reply)
        (sample,) = run(env, model, tasks=env.tasks("train")).samples
        assert (sample.status, sample.reward) == (Status.COMPLETED, reward)


def test_a_reward_that_never_returns_fails_its_sample_at_the_episode_timeout(
    smollm2: ChatTokenizer,
) -> None:
    """Training bounds an episode's time (``--episode-timeout``) as evaluation does: a sync
    reward that never returns fails its samples naming the timeout; the others are kept."""
    release = threading.Event()

    def hangs_on_t0(task: Task, state: State) -> float:
        if task.id == "t0":
            release.wait(120)  # set only after the round: its threads are abandoned
        return 1.0

    producers: list[Producer] = []

    async def go() -> None:
        async with Buffer(BUFFER) as buffer:
            producers.append(producer_for(Rubric(hangs_on_t0), smollm2, buffer, 2,
                                          episode_timeout=1.0))  # fmt: skip
            producers[0].policy.inner.weight_version = "0"  # the Buffer counts versions
            await producers[0].play(TASKS[:2], seed=0)

    try:
        anyio.run(go)
    finally:
        release.set()
    stats = producers[0].stats
    assert stats.episodes == 4 and stats.failed == 2  # t0's two episodes, t1's kept


def test_episode_timeout_is_a_train_flag(tmp_path: Path) -> None:
    config = _config(tmp_path, "--rm-type", "f1", "--episode-timeout", "30")
    assert config.rollout.episode_timeout == 30.0
    assert _config(tmp_path, "--rm-type", "f1").rollout.episode_timeout == 600.0
