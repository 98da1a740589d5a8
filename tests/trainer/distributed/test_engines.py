"""Engines as Ray actors behind SGLang's real router (``sglang-router``), serving
``agentenv serve`` workers on a tiny random Llama: generations through the router, weights
synced from disk and over gloo into every engine at the exact version, and an engine
actor killed mid-rollout, replaced while its requests finish on the other engine."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch

from agentenv import ConfigError, SamplingParams
from agentenv.sglang import SGLangClient
from tests.trainer.test_loop import tiny_llama
from trainer.distributed import EngineGroup, EngineSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.anyio]

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


class Weights:
    """The trainer's side of a sync: a state dict, or HF files on disk."""

    def __init__(self, model: Path, scale: float) -> None:
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model)
        with torch.no_grad():  # another policy: the greedy tokens change
            self.model.lm_head.weight.mul_(scale).add_(torch.randn_like(self.model.lm_head.weight))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())

    def save_hf(self, directory: Path) -> None:
        self.model.save_pretrained(directory, safe_serialization=True)


@pytest.fixture(scope="module")
async def group(ray_cluster: None, model: Path) -> AsyncIterator[EngineGroup]:
    spec = EngineSpec(
        str(model), kind="serve", gpus_per_engine=1, host="127.0.0.1",
        server_args=("--max-running", "16"), cpus_per_engine=1, health_timeout=120,
    )  # fmt: skip
    # Round robin (a --router-* flag passed through): each engine gets half the requests.
    async with EngineGroup(
        spec, 2, router_args=["--policy", "round_robin"], health_interval=1.0
    ) as engines:
        yield engines


def _prompt(i: int) -> list[int]:
    return [1, 1000 + i, 1001, 1002 + i]


async def _versions(group: EngineGroup) -> list[str]:
    out = []
    for info in group.engines:
        async with SGLangClient(info.url) as c:
            out.append(await c.weight_version())
    return out


async def _load(url: str) -> int:
    async with httpx.AsyncClient(base_url=url) as http:
        return int((await http.get("/get_load")).json()[0]["num_reqs"])


async def _greedy(url: str) -> list[int]:
    async with SGLangClient(url) as c:
        return (await c.generate(_prompt(0), GREEDY)).output_ids


async def test_two_engine_actors_behind_the_router_serve_generations(group: EngineGroup) -> None:
    infos = group.engines
    assert len(infos) == 2 and len({i.url for i in infos}) == 2
    assert all(len(i.gpu_ids) == 1 for i in infos)  # one logical GPU each
    assert len({i.gpu_ids for i in infos}) == 2
    async with SGLangClient(group.router_url) as router:
        assert sorted(await router.list_workers()) == sorted(i.url for i in infos)
        through_client = await router.generate(_prompt(1), GREEDY)  # any SGLang client
    results = [None] * 8

    async def one(i: int) -> None:
        results[i] = await group.generate(_prompt(i), GREEDY, rid=f"ep{i}/0")

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
    assert all(r is not None and len(r.output_ids) == 6 for r in results)
    assert results[1] is not None and results[1].output_ids == through_client.output_ids
    assert group.statistics().routed == 2


async def test_disk_sync_reaches_every_engine_at_the_exact_version(
    group: EngineGroup, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    before = await _greedy(group.engines[0].url)
    sync = group.weight_sync("disk", directory=tmp_path_factory.mktemp("weights"))
    await sync(Weights(model, scale=-1.0), 1)  # type: ignore[arg-type]
    assert await _versions(group) == ["1", "1"]
    outputs = [await _greedy(i.url) for i in group.engines]
    assert outputs[0] == outputs[1] != before
    c = await group.generate(_prompt(0), GREEDY)
    assert c.weight_version == "1" and c.output_ids == outputs[0]
    assert group.weight_version == "1"


async def test_a_killed_engine_mid_rollout_is_replaced_and_the_rollout_completes(
    group: EngineGroup, caplog: pytest.LogCaptureFixture
) -> None:
    import ray

    caplog.set_level(logging.INFO, logger="trainer.distributed")
    victim, survivor = group.engines
    # Both engines hold their requests (paused in place) until the victim is killed.
    for info in (victim, survivor):
        async with SGLangClient(info.url) as c:
            await c.pause("in_place")
    results: list[Any] = [None] * 8

    async def one(i: int) -> None:
        results[i] = await group.generate(_prompt(i), GREEDY, rid=f"ep{i}/0")

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(one, i)
        with anyio.fail_after(60):
            while True:  # each engine says what it holds (SGLang's /get_load)
                load = [await _load(i.url) for i in (victim, survivor)]
                if load[0] > 0 and sum(load) == 8:
                    break
                await anyio.sleep(0.05)
        ray.kill(group._members[0].actor, no_restart=True)  # mid-rollout
        async with SGLangClient(survivor.url) as c:
            await c.resume()
    version = group.weight_version or "default"  # "1" after the disk sync above
    assert all(r is not None and len(r.output_ids) == 6 for r in results), results
    assert {r.weight_version for r in results} == {version}
    await group.wait_ready(timeout=120)
    stats = group.statistics()
    assert stats.deaths == 1 and stats.replacements == 1 and stats.routed == 2
    assert stats.retried_requests >= 1 and stats.failed_requests == 0
    assert group.metrics()["rollout/engine_replacements"] == 1.0
    fresh = group.engines[0]
    assert fresh.url != victim.url
    assert await _versions(group) == [version, version]  # caught up from the last sync
    text = caplog.text
    assert f"engine 0 at {victim.url}" in text and "is dead" in text
    assert "retrying on the others" in text and "engine 0 replaced by" in text
    async with SGLangClient(group.router_url) as router:
        assert sorted(await router.list_workers()) == sorted(i.url for i in group.engines)


async def test_distributed_gloo_sync_reaches_every_engine_at_the_exact_version(
    group: EngineGroup, model: Path
) -> None:
    weights = Weights(model, scale=2.0)
    sync = group.weight_sync("distributed", backend="gloo", bucket_bytes=1 << 20, timeout=60)
    try:
        await sync(weights, 2)  # type: ignore[arg-type]
        assert await _versions(group) == ["2", "2"]
        outputs = [await _greedy(i.url) for i in group.engines]
        assert outputs[0] == outputs[1]
        await sync(weights, 3)  # the group stays formed between syncs
        assert await _versions(group) == ["3", "3"]
        c = await group.generate(_prompt(0), GREEDY)
        assert c.weight_version == "3" and c.output_ids == outputs[0]
    finally:
        await sync.aclose()


async def test_a_replacement_waits_for_the_next_distributed_sync_then_is_routed(
    group: EngineGroup, model: Path
) -> None:
    """Distributed weights cannot be read again from disk: the new engine holds the
    checkpoint's, so it gets no request until the next sync gives it the current ones."""
    import ray

    sync = group.weight_sync("distributed", backend="gloo", bucket_bytes=1 << 20, timeout=60)
    try:
        weights = Weights(model, scale=3.0)
        await sync(weights, 4)
        victim = group.engines[1]
        ray.kill(group._members[1].actor, no_restart=True)
        await group.check()  # what the watcher does every health_interval
        with anyio.fail_after(120):
            while group.statistics().replacements < 2:
                await group._changed.wait()
        stats = group.statistics()
        assert stats.routed == 1 and group.engines[1].url != victim.url
        async with SGLangClient(group.router_url) as router:
            assert await router.list_workers() == [group.engines[0].url]
        for _ in range(4):  # every request goes to the engine at version 4
            assert (await group.generate(_prompt(0), GREEDY)).weight_version == "4"
        await sync(weights, 5)  # a new process group, with the new engine in it
        await group.wait_ready(timeout=60)
        assert group.statistics().routed == 2
        assert await _versions(group) == ["5", "5"]
    finally:
        await sync.aclose()


async def test_colocated_engines_release_and_resume_their_memory(group: EngineGroup) -> None:
    from agentenv.sglang import SGLangError

    await group.release_memory(["kv_cache"])
    for info in group.engines:
        async with SGLangClient(info.url) as c:
            with pytest.raises(SGLangError, match="memory is released"):
                await c.generate(_prompt(0), GREEDY)
    await group.resume_memory()
    assert len((await group.generate(_prompt(0), GREEDY)).output_ids) == 6
    assert group.statistics().deaths == 2  # a released engine is alive: not replaced


async def test_engines_run_on_the_placement_group_bundles_they_are_given(
    ray_cluster: None, model: Path
) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    from trainer.distributed import EngineSlot

    pg = placement_group([{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}])
    assert pg.wait(60)
    try:
        spec = EngineSpec(str(model), host="127.0.0.1", cpus_per_engine=0.5, health_timeout=120)
        slots = [EngineSlot(pg, 1), EngineSlot(pg, 0, num_gpus=0.5, gpu_ids=("7",))]
        async with EngineGroup(spec, 2, slots=slots) as engines:
            assert engines.engines[1].gpu_ids == ("7",)  # the measured ids win
            assert len((await engines.generate(_prompt(0), GREEDY)).output_ids) == 6
    finally:
        remove_placement_group(pg)


async def test_bad_settings_are_refused_naming_the_value(ray_cluster: None, model: Path) -> None:
    from trainer.distributed import EngineSlot

    spec = EngineSpec(str(model))
    with pytest.raises(ConfigError, match="one slot per engine: 2 engines, 1 slots given"):
        EngineGroup(spec, 2, slots=[EngineSlot(None, 0)])
    with pytest.raises(ConfigError, match="num_engines must be at least 1, got 0"):
        EngineGroup(spec, 0)
    with pytest.raises(ConfigError, match=r"rollout-num-gpus-per-engine.*got -1"):
        EngineSpec(str(model), gpus_per_engine=-1)
    with pytest.raises(ConfigError, match="needs a directory"):
        EngineGroup(spec, 1).weight_sync("disk")
    assert EngineSpec("m", kind="sglang", gpus_per_engine=2).command("h", 1)[-2:] == [
        "--tp-size",
        "2",
    ]


async def test_an_engine_that_does_not_start_is_named_with_its_output(
    ray_cluster: None, tmp_path: Path
) -> None:
    from trainer.distributed import EngineGroupError

    spec = EngineSpec(str(tmp_path / "nothing"), host="127.0.0.1", health_timeout=60)
    with pytest.raises(EngineGroupError, match=r"engine 0 did not start: .*exited with code"):
        async with EngineGroup(spec, 1):
            pass
