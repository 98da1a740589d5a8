"""The driver on Ray: the same loop as a run in one process, talking to actor groups. A
run on Ray gives the samples and the updates of a run in one process for the same seed;
``--colocate`` releases the engines' memory around each training step; an engine actor
killed between steps is replaced and the run's metrics say so."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trainer
from agentenv import ChatTokenizer, ConfigError, Rubric, SamplingParams, State, Task
from tests.trainer.test_loop import GoodTokensEnv, good_tokens, tiny_llama
from trainer import GRPOConfig, LossConfig, OptimConfig, TorchBackend, run_grpo
from trainer.distributed import EngineGroup, EngineHooks, EngineSpec

# What depends on the samples (their rewards and lengths) and on the updates.
SAMPLED = ("reward_mean", "batch/reward_mean", "samples", "rollout/completion_tokens")
TRAINED = ("train/loss", "train/grad_norm")


PLAYED: list[tuple[str, tuple[int, ...]]] = []  # (task, completion ids) of each episode scored


def _recorded(task: Task, state: State) -> float:
    PLAYED.append((task.id, tuple(state.transcript.current.completion_ids)))
    return good_tokens(task, state)


class RecordingEnv(GoodTokensEnv):
    """Scores as :class:`GoodTokensEnv` and records every completion it scores (the
    episodes are scored in the driver's process, on Ray too)."""

    rubric = Rubric(_recorded)


def _played() -> list[tuple[str, tuple[int, ...]]]:
    out = sorted(PLAYED)
    PLAYED.clear()
    return out


def _run(base: dict[str, Any], save: Path, **flags: Any) -> list[dict[str, float]]:
    trainer.train(trainer.TrainConfig(**base, save=save, **flags))
    lines = (save / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _weights(save: Path, name: str = "model") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted((save / name).glob("*.safetensors")):
        out |= load_file(f)
    return out


def _base(model: Path) -> dict[str, Any]:
    return dict(
        env=f"{__name__}:RecordingEnv", hf_checkpoint=str(model), device="cpu",
        rollout_engine="serve", rollout_batch_size=2, n_samples_per_prompt=4,
        rollout_max_response_len=6, n_eval=2, lr=1e-2, num_rollout=2, rollout_seed=3,
        use_tensorboard=False,
        # The tiny model learns the task in a step; the entropy term keeps a gradient in
        # every step (a step without one is not trained), so every step trains and syncs.
        entropy_coef=1e-3,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_on_ray_gives_the_samples_and_updates_of_a_run_in_one_process(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """In one process with a launched ``agentenv serve``; on Ray with one trainer actor and
    an engine actor behind the router; on Ray with two data-parallel trainer actors and two
    engine actors."""
    model = tiny_llama(tmp_path / "tiny")
    base = _base(model)
    local = _run(base, tmp_path / "local")
    played = _played()
    ray = dict(ray_address="local", rollout_num_gpus=1)
    one = _run(base, tmp_path / "ray1", **ray)
    assert _played() == played  # the same token ids, episode for episode
    # Two trainer ranks and two engines, the router spreading the episodes over them.
    two = _run(
        base, tmp_path / "ray2", ray_address="local", rollout_num_gpus=2,
        actor_num_gpus_per_node=2, router_args=["--policy", "round_robin"],
    )  # fmt: skip
    assert _played() == played
    assert len(played) == 2 * 8 + 2 * 2  # two steps' episodes, the evaluations before and after
    assert len(set(played)) > len(played) // 2  # sampled, not greedy: the episodes differ
    assert len(local) == len(one) == len(two) == 2
    for a, b, c in zip(local, one, two, strict=True):
        for name in SAMPLED:  # the same samples: the seeds are the episodes', not the engine's
            # (means of the same numbers, summed in the order the episodes finished)
            assert b[name] == pytest.approx(a[name], rel=1e-12), (name, a[name], b[name])
            assert c[name] == pytest.approx(a[name], rel=1e-12), (name, a[name], c[name])
        for name in TRAINED:
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name
            assert c[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name
        assert b["rollout/engine_deaths"] == 0.0 and "rollout/engine_deaths" not in a
        assert (b["rollout/engine_routed"], c["rollout/engine_routed"]) == (1.0, 2.0)
    want = _weights(tmp_path / "local")
    start = _weights(tmp_path, "tiny")  # the model the runs began from
    assert any(not torch.equal(start[name], w) for name, w in want.items())  # it trained
    for got in (_weights(tmp_path / "ray1"), _weights(tmp_path / "ray2")):
        assert got.keys() == want.keys()
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_colocated_engines_release_their_memory_around_each_training_step(
    ray_cluster: Any, tmp_path: Path
) -> None:
    model = tiny_llama(tmp_path / "tiny")
    history = _run(_base(model), tmp_path / "run", ray_address="local", colocate=True)
    assert [m["rollout/engine_memory_releases"] for m in history] == [1.0, 2.0]
    # Resumed before each sync: the rollouts and the evaluation after the run were served.
    assert all(m["samples"] == 8 for m in history)


@pytest.mark.parametrize("schedule", ["one_step_off", "async"])
def test_colocate_is_refused_on_schedules_that_overlap_rollouts_and_training(
    schedule: str,
) -> None:
    with pytest.raises(ConfigError, match=f"--colocate with --schedule {schedule}"):
        trainer.TrainConfig(
            env="tests.trainer.test_loop:GoodTokensEnv", rollout_engine="serve", colocate=True,
            schedule=schedule, max_staleness=1,
        )  # fmt: skip


class KillingHooks(EngineHooks):
    """Colocated hooks that kill engine 1's actor just before step 2's release: the
    release finds it gone."""

    async def before_train(self, step: int) -> None:
        if step == 2:
            victim = self.group._members[1].actor
            ray_kill(victim)
            # The kill is asynchronous: a call made just after it may still be served. Ask
            # until Ray reports the actor dead (the test's timeout bounds the wait).
            while await _alive(victim):  # noqa: ASYNC110 - Ray has no event for it
                await anyio.sleep(0.1)
        await super().before_train(step)


async def _alive(actor: Any) -> bool:
    from ray.exceptions import RayActorError

    try:
        await actor.alive.remote()
    except RayActorError:
        return False
    return True


def ray_kill(actor: Any) -> None:
    import ray

    ray.kill(actor, no_restart=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engines_killed_between_steps_are_replaced_and_the_metrics_say_so(
    ray_cluster: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine 0 dies after step 0 (step 1's requests on it are retried on engine 1);
    engine 1 dies before step 2's colocated release (the release, or the resume after,
    finds it gone, or the group's check finds it first). Both are replaced and every step
    trains on a full batch."""
    caplog.set_level(logging.INFO, logger="trainer.distributed")
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    env = GoodTokensEnv()
    # (The entropy term keeps a gradient in every step: see _base.)
    backend = TorchBackend(model, optim=OptimConfig(lr=1e-2), loss=LossConfig(entropy_coef=1e-3))
    config = GRPOConfig(
        num_rollout=4, rollout_batch_size=2, n_samples_per_prompt=4,
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True),
    )  # fmt: skip
    spec = EngineSpec(
        str(model), kind="serve", gpus_per_engine=1, host="127.0.0.1",
        server_args=("--max-running", "16"), cpus_per_engine=1, health_timeout=120,
    )  # fmt: skip

    async def go() -> list[dict[str, float]]:
        async with EngineGroup(
            spec, 2, router_args=["--policy", "round_robin"], health_interval=1.0
        ) as group:
            first = group._members[0].actor

            def on_step(metrics: dict[str, float]) -> None:
                if metrics["step"] == 0:  # between steps 0 and 1
                    ray_kill(first)
                if metrics["step"] in (1, 2):  # the next step is served by both again
                    anyio.from_thread.run(group.wait_ready)

            return await run_grpo(
                env, env.tasks(), backend, group, tokenizer, config,
                sync=group.weight_sync("disk", directory=tmp_path / "weights"),
                hooks=KillingHooks(group, colocated=True), on_step=on_step,
            )  # fmt: skip

    history = anyio.run(go)
    assert [m["samples"] for m in history] == [8, 8, 8, 8]  # every step trained a full batch
    assert history[0]["rollout/engine_deaths"] == 0.0
    assert history[1]["rollout/engine_deaths"] == 1.0
    assert [m["rollout/engine_memory_releases"] for m in history] == [1.0, 2.0, 3.0, 4.0]
    last = history[-1]
    assert last["rollout/engine_deaths"] == 2.0 and last["rollout/engine_replacements"] == 2.0
    assert last["rollout/engine_routed"] == 2.0 and last["rollout/engine_failed_requests"] == 0
    assert "engine 0 replaced by" in caplog.text and "engine 1 replaced by" in caplog.text
