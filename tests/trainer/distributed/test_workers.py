"""Rollout workers as Ray actors: they build the environment themselves, play the rounds
the driver deals them through an ``agentenv serve`` engine and put the groups into the
driver's Buffer, served to them. A worker killed mid-round has its part played again on
the other, and every group is in the Buffer exactly once; a task that kills every worker
it runs on is failed with that reason and alone; a worker that cannot build the
environment fails the start with its error; a run with workers gives the samples of a
run in one process."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import trainer
from agentenv import ChatTokenizer, ConfigError, RolloutConfig, Rubric, SamplingParams, State, Task
from agentenv.buffer import Buffer, BufferConfig
from agentenv.engine import Engine, EngineServer
from tests.trainer.test_loop import GoodTokensEnv, good_tokens, tiny_llama
from trainer.distributed import RolloutWorkers, WorkerSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SAMPLED = ("reward_mean", "batch/reward_mean", "samples", "rollout/completion_tokens")
N = 2  # samples per prompt


def _slow(task: Task, state: State) -> float:
    import time

    time.sleep(0.3)  # a verifier that takes its time: the round is still running
    return good_tokens(task, state)


class SlowEnv(GoodTokensEnv):
    rubric = Rubric(_slow)


def _poison(task: Task, state: State) -> float:
    if task.id == "poison":
        os._exit(3)  # takes its worker's process with it
    return good_tokens(task, state)


class PoisonEnv(GoodTokensEnv):
    rubric = Rubric(_poison)

    def tasks(self, split: str = "train") -> list[Task]:
        return [*super().tasks(split)[:3], Task(id="poison", prompt="x")]


class BrokenEnv(GoodTokensEnv):
    def __init__(self, **kwargs: Any) -> None:
        raise RuntimeError("no such verifier on this node")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
async def served(model: Path) -> AsyncIterator[tuple[str, ChatTokenizer]]:
    tokenizer = ChatTokenizer.load(model)
    async with (
        Engine(model, device="cpu", tokenizer=tokenizer) as engine,
        EngineServer(engine) as server,
    ):
        yield server.url, tokenizer


def _config() -> RolloutConfig:
    return RolloutConfig(
        n_samples_per_prompt=N, sampling=SamplingParams(max_new_tokens=4), seed=5, concurrency=8
    )


def _buffer() -> Buffer:
    return Buffer(BufferConfig(n_samples_per_prompt=N))


async def _groups(buffer: Buffer) -> list[str]:
    stats = await buffer.statistics()
    batch = await buffer.get_batch(stats.ready) if stats.ready else None
    return sorted(g.task_id or "" for g in batch.groups) if batch else []


@pytest.mark.anyio
async def test_a_killed_workers_part_is_played_again_and_every_group_is_put_once(
    ray_cluster: Any, served: tuple[str, ChatTokenizer], model: Path, tmp_path: Path
) -> None:
    url, _ = served
    spec = WorkerSpec(f"{__name__}:SlowEnv", {}, str(model), url, concurrency=2)
    tasks = SlowEnv().tasks("train")[:8]
    group = RolloutWorkers(spec, 2, announce=tmp_path)
    async with _buffer() as buffer, group.serving(buffer) as workers:
        assert len(workers.live()) == 2
        victim = workers.live()[0]

        async def kill_once_a_group_is_in() -> None:
            with anyio.fail_after(120):
                while (await buffer.statistics()).groups_put < 1:  # noqa: ASYNC110 - remote puts
                    await anyio.sleep(0.05)
            ray_cluster.kill(victim.actor, no_restart=True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_once_a_group_is_in)
            result = await workers.play(tasks, _config())
        metrics = workers.metrics()
        assert metrics["rollout/worker_retries"] >= 1 and metrics["rollout/worker_restarts"] == 1
        assert metrics["rollout/workers_alive"] == 1  # until the replacement joins
        assert sorted(await _groups(buffer)) == sorted(t.id for t in tasks)  # each once
        assert result.stats.episodes >= len(tasks) * N
        stats = await buffer.statistics()
        assert stats.kept == len(tasks) and stats.in_flight == 0
        # The served Buffer, from another process: agentenv buffer stats SAVE/buffer.json.
        cmd = [sys.executable, "-m", "agentenv", "buffer", "stats", str(tmp_path / "buffer.json")]
        done = await anyio.run_process([*cmd, "--json"], check=False)
        assert done.returncode == 0, done.stderr.decode()
        live = json.loads(done.stdout.decode().splitlines()[-1])
        assert live["kept"] == len(tasks) and live["groups_put"] == stats.groups_put
        # The replacement joins; the next round runs on both.
        await workers.wait_ready(timeout=120)
        assert workers.metrics()["rollout/workers_alive"] == 2
        await workers.play(SlowEnv().tasks("train")[8:10], _config())
        assert workers.metrics()["rollout/worker_restarts"] == 1


@pytest.mark.anyio
async def test_a_task_that_kills_its_workers_is_failed_alone_with_that_reason(
    ray_cluster: Any, served: tuple[str, ChatTokenizer], model: Path
) -> None:
    url, _ = served
    spec = WorkerSpec(f"{__name__}:PoisonEnv", {}, str(model), url, concurrency=4)
    tasks = PoisonEnv().tasks("train")
    async with (
        _buffer() as buffer,
        RolloutWorkers(spec, 2, max_task_retries=1).serving(buffer) as workers,
    ):
        result = await workers.play(tasks, _config())
        stats = await buffer.statistics()
        assert stats.groups_put == len(tasks)
        batch = await buffer.get_batch(stats.ready) if stats.ready else None
        played = {g.task_id for g in batch.groups} if batch else set()
        assert played == {t.id for t in tasks if t.id != "poison"}  # the others trained
        assert result.stats.failed["WorkerDied"] == N
        reasons = list(result.stats.failure_reasons)
        assert any("rollout worker died 2 time(s) playing this task" in r for r in reasons)
        assert workers.metrics()["rollout/worker_failed_parts"] == 1


@pytest.mark.anyio
async def test_a_worker_that_cannot_build_the_environment_fails_the_start(
    ray_cluster: Any, served: tuple[str, ChatTokenizer], model: Path
) -> None:
    url, _ = served
    cases = {
        f"{__name__}:BrokenEnv": "RuntimeError: no such verifier on this node",
        "tests.nowhere:Env": "No module named 'tests.nowhere'",
    }
    for env, message in cases.items():
        spec = WorkerSpec(env, {}, str(model), url)
        with anyio.fail_after(120), pytest.raises(ConfigError, match=message):
            async with _buffer() as buffer, RolloutWorkers(spec, 1).serving(buffer):
                pass
    spec = WorkerSpec("arithmetic", {"max_operand": "nine"}, str(model), url)
    with pytest.raises(ConfigError, match="could not build the environment 'arithmetic'"):
        async with _buffer() as buffer, RolloutWorkers(spec, 1).serving(buffer):
            pass


def test_a_run_with_rollout_workers_gives_the_samples_of_a_run_in_one_process(
    ray_cluster: Any, tmp_path: Path, model: Path
) -> None:
    base: dict[str, Any] = dict(
        env="tests.trainer.test_loop:GoodTokensEnv", hf_checkpoint=str(model), device="cpu",
        rollout_engine="serve", rollout_batch_size=2, n_samples_per_prompt=4,
        rollout_max_response_len=6, n_eval=0, lr=1e-2, num_rollout=2, rollout_seed=3,
        use_tensorboard=False,
    )  # fmt: skip

    def run(save: Path, **flags: Any) -> list[dict[str, float]]:
        trainer.train(trainer.TrainConfig(**base, save=save, **flags))
        return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]

    local = run(tmp_path / "local")
    remote = run(
        tmp_path / "workers", ray_address="local", rollout_num_gpus=1, rollout_num_workers=2
    )
    for a, b in zip(local, remote, strict=True):
        for name in SAMPLED:
            assert b[name] == pytest.approx(a[name], rel=1e-12), (name, a[name], b[name])
        assert b["rollout/workers_alive"] == 2.0 and b["rollout/worker_restarts"] == 0.0
        assert b["rollout/worker_retries"] == 0.0
    # The peak resident set covers every process of the run: the trainer rank, the engine
    # actor with its server, the rollout workers and this one -- each role's largest, and
    # the largest.
    roles = {k: v for k, v in remote[-1].items() if k.startswith("perf/peak_rss_gib/")}
    kinds = ("driver", "trainer_ranks", "engines", "rollout_workers")
    assert set(roles) == {f"perf/peak_rss_gib/{r}" for r in kinds}
    assert min(roles.values()) > 0.05 and remote[-1]["perf/peak_rss_gib"] == max(roles.values())


@pytest.mark.anyio
async def test_a_worker_over_its_memory_limit_is_replaced_after_its_round(
    ray_cluster: Any, served: tuple[str, ChatTokenizer], model: Path
) -> None:
    url, _ = served
    # 1 MB: every worker is over it (an environment that leaks, as far as the limit knows).
    spec = WorkerSpec(f"{__name__}:SlowEnv", {}, str(model), url, max_worker_rss_mb=1.0)
    tasks = SlowEnv().tasks("train")[:4]
    async with _buffer() as buffer, RolloutWorkers(spec, 2).serving(buffer) as workers:
        await workers.play(tasks, _config())
        assert (await buffer.statistics()).kept == len(tasks)  # the round's groups are in
        metrics = workers.metrics()
        assert metrics["rollout/worker_recycled"] == 2 and metrics["rollout/worker_restarts"] == 2
        await workers.wait_ready(timeout=120)
        assert workers.metrics()["rollout/workers_alive"] == 2  # the replacements


def test_workers_the_cluster_cannot_hold_are_refused_before_anything_is_placed(
    ray_cluster: Any,
) -> None:
    from trainer.run._setup import place_run

    base: dict[str, Any] = dict(env="arithmetic", rollout_url="http://127.0.0.1:9")
    free = ray_cluster.available_resources().get("CPU")
    cases = {
        (3, 4.0): "--rollout-num-workers 3 x --rollout-num-cpus-per-worker 4 = 12 CPUs for the "
        "rollout workers, beside the 1 of the trainer and engine bundles, but the cluster has "
        "8 CPUs on 1 node(s): pass --rollout-num-cpus-per-worker 2.33 (a worker mostly waits "
        "on the engines), or --rollout-num-workers 1, or add nodes",
        (1, 16.0): "--rollout-num-cpus-per-worker 16: no node has that many CPUs (the cluster "
        "has 8 CPUs on 1 node(s), at most 8 on one): pass --rollout-num-cpus-per-worker 8 or less",
    }  # fmt: skip
    for (n, cpus), message in cases.items():
        config = trainer.TrainConfig(
            **base, rollout_num_workers=n, rollout_num_cpus_per_worker=cpus
        )
        with pytest.raises(ConfigError) as e:
            place_run(config)
        assert message in str(e.value)
    config = trainer.TrainConfig(**base, rollout_num_workers=2, rollout_worker_resource="sandbox")
    with pytest.raises(ConfigError, match="--rollout-worker-resource sandbox: the 2 rollout"):
        place_run(config)
    # Nothing was placed: no CPU more is held (an earlier test's actors may still be
    # handing theirs back, so the cluster can only have as many free or more).
    assert ray_cluster.available_resources().get("CPU", 0.0) >= (free or 0.0)
